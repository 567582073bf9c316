"""Repository workspaces on a sandbox pool: warm per repository, forked in milliseconds.

A workspace is one episode's sandbox (worker.py with workspace_init.py as its init) with the
repository mounted at /workspace: overlayfs over the repository's base layer (layers.py) with an
empty upper layer on a tmpfs the size of the episode's disk limit. Nothing of the repository is
copied per episode; the base is copied once per repository, when the pool first sees it.

- Warm pools per repository: after a repository's first episode the pool keeps
  `warm_per_repository` sandboxes started with its base already mounted (`max_warm` in all, the
  least recently used repository's given up first), so `open` hands one over without starting
  anything. `prewarm` fills them before any episode asks. Setup time (`open`'s wall clock) is the
  looprl_workspace_setup_seconds metric, by start (warm or cold).
- Fork: the parent's sandbox copies its upper layer (what the episode changed, not the repository)
  into a frozen layer; the fork is another sandbox mounting a new empty upper over that layer and
  the parent's lowers. Parent and fork diverge from there and neither sees the other's writes.
  A fork can lay files on top (a task's hidden tests, in its scoring fork only) and undo the
  episode's changes to named files (pytest's configuration).
- Limits: the sandbox's cgroup bounds the episode's memory (its written files included), processes
  and CPU rate; the pool refuses commands once the episode's CPU time or wall clock is spent, and
  closes workspaces whose wall clock ran out even if their episode never says so.

Workspaces are named by string ids so the same calls go through a Ray actor (fleet.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.environment_sandbox.sandbox.job import InvalidJob, SandboxError
from services.environment_sandbox.sandbox.layers import LayerStore
from services.environment_sandbox.sandbox.runtime import build_runtime
from services.kit.telemetry.metrics import counter, gauge, histogram, observe

# The pool (pool.SandboxPool) and its workers (pool._Worker) are passed in, never imported: the pool
# makes this object (SandboxPool.workspaces).
SandboxPool = _Worker = Any
log = logging.getLogger(__name__)
SETUP_SECONDS = histogram("looprl_workspace_setup_seconds")
FORK_SECONDS = histogram("looprl_workspace_fork_seconds")
LIVE = gauge("looprl_workspaces")
COMMANDS = counter("looprl_workspace_commands_total")
REAP_GRACE_S = 30.0
REAP_INTERVAL_S = 5.0


class WorkspaceError(SandboxError):
    """A workspace op that cannot be done: unknown or closed workspace, budget or wall clock spent."""


@dataclass(eq=False)
class _Workspace:
    id: str
    repo: str  # the base layer: workspaces of one repository share it
    lowers: list[str]  # top first, the base last
    agent_layers: list[str]  # frozen copies of what episodes wrote (a subset of lowers)
    worker: _Worker
    deadline: float
    cpu_start: float
    holds_slot: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    commands: int = 0


class WorkspacePool:
    """Workspaces on one SandboxPool's host. Use from the pool's event loop."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool
        self.config = pool.config.workspace
        self._layers: LayerStore | None = None
        self._runtime: Path | None = None
        self._runtime_lock = asyncio.Lock()
        self._base_locks: dict[str, asyncio.Lock] = {}
        self._warm: OrderedDict[str, deque[_Worker]] = OrderedDict()
        self._warming: dict[str, int] = {}
        self._live: dict[str, _Workspace] = {}
        self._slots = asyncio.Semaphore(self.config.max_workspaces)
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None
        self._closed = False
        self.opened = self.warm_hits = self.forks = 0

    # -- the calls -----------------------------------------------------------------------------------

    async def open(self, repository: str, commit: str = "", episode_timeout_s: float = 0.0) -> dict[str, Any]:
        """A new workspace over the repository (a local directory, git repository at `commit`, or
        archive); {"id", "setup_seconds", "warm"}. The wall clock runs from here."""
        self._check_open()
        started = time.perf_counter()
        await self._slots.acquire()
        try:
            base = await self._base(repository, commit)
            worker, warm = self._take_warm(base), True
            if worker is None:
                warm = False
                worker = await self._spawn([base])
            self._top_up(base)
        except BaseException:
            self._slots.release()
            raise
        timeout = min(episode_timeout_s or self.config.episode_timeout_s, self.config.episode_timeout_s)
        ws = self._register(base, [base], [], worker, time.monotonic() + timeout, holds_slot=True)
        setup = time.perf_counter() - started
        self.opened += 1
        self.warm_hits += warm
        observe(SETUP_SECONDS.labels("warm" if warm else "cold"), setup)
        return {"id": ws.id, "setup_seconds": setup, "warm": warm}

    async def run(
        self,
        workspace_id: str,
        argv: list[str],
        stdin: str = "",
        timeout_s: float = 0.0,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run one command in the workspace; {"exit_code", "output", "truncated", "timed_out",
        "killed_reason", "wall_seconds"}. Its processes all end with it."""
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidJob("argv: must be a non-empty list of strings")
        ws = self._get(workspace_id)
        async with ws.lock:
            remaining = ws.deadline - time.monotonic()
            if remaining <= 0:
                COMMANDS.labels("refused").inc()
                raise WorkspaceError(f"workspace {workspace_id}: the episode's wall clock is spent")
            cgroup = ws.worker.cgroup
            if cgroup is not None and cgroup.cpu_usage_s() - ws.cpu_start > self.config.cpu_seconds:
                COMMANDS.labels("refused").inc()
                raise WorkspaceError(
                    f"workspace {workspace_id}: the episode's CPU time ({self.config.cpu_seconds:g} s) is spent"
                )
            timeout = min(
                timeout_s or self.config.command_timeout_s, self.config.max_command_timeout_s, remaining
            )
            ooms = cgroup.oom_kills() if cgroup is not None else 0
            reply = await ws.worker.request(
                {
                    "op": "run",
                    "argv": argv,
                    "stdin": stdin,
                    "env": dict(env or {}),
                    "timeout_s": timeout,
                    "max_output_bytes": self.config.max_output_bytes,
                }
            )
            ws.commands += 1
        reply["killed_reason"] = ""
        if reply["timed_out"]:
            reply["killed_reason"] = "timeout"
        elif cgroup is not None and cgroup.oom_kills() > ooms:
            reply["killed_reason"] = "memory"
        result = (
            "timeout" if reply["timed_out"] else ("exit_0" if reply["exit_code"] == 0 else "exit_nonzero")
        )
        COMMANDS.labels(result).inc()
        return reply

    async def fork(
        self,
        workspace_id: str,
        files: dict[str, str] | None = None,
        tests: dict[str, str] | None = None,
        revert: tuple[str, ...] = (),
        timeout_s: float = 0.0,
    ) -> dict[str, Any]:
        """A new workspace holding what this one holds now; {"id", "fork_seconds"}. `files` are laid
        on top of the workspace, `tests` are bound read-only at /tests, and changes to files named in
        `revert` are undone (see workspace_init.op_freeze). The fork shares the parent's wall clock,
        or has `timeout_s` of its own (a scoring fork, made when the episode's time may be spent)."""
        started = time.perf_counter()
        parent = self._get(workspace_id)
        if len(parent.lowers) + 2 > self.config.max_layers:
            raise WorkspaceError(
                f"workspace {workspace_id}: forking would stack more than max_layers={self.config.max_layers} layers"
            )
        layer = self.layers.frozen_name()
        async with parent.lock:
            await parent.worker.request(
                {
                    "op": "freeze",
                    "layer": layer,
                    "revert": list(revert),
                    "agent_layers": parent.agent_layers,
                    "base": parent.repo,
                }
            )
        try:
            lowers = [layer, *parent.lowers]
            if files:
                lowers.insert(0, await asyncio.to_thread(self.layers.files, files))
            tests_layer = await asyncio.to_thread(self.layers.files, tests) if tests else ""
            worker = self._take_warm(parent.repo)
            if worker is None:
                worker = await self._spawn(lowers, tests_layer)
            else:
                await worker.request({"op": "mount", "lowers": lowers, "tests": tests_layer})
            self._top_up(parent.repo)
        except BaseException:
            self.layers.discard(layer)
            raise
        deadline = (
            time.monotonic() + min(timeout_s, self.config.episode_timeout_s) if timeout_s else parent.deadline
        )
        child = self._register(
            parent.repo, lowers, [layer, *parent.agent_layers], worker, deadline, holds_slot=False
        )
        seconds = time.perf_counter() - started
        self.forks += 1
        observe(FORK_SECONDS, seconds)
        return {"id": child.id, "fork_seconds": seconds}

    async def close(self, workspace_id: str | None = None) -> None:
        """Close one workspace (its processes end, its upper layer is gone); with no id, every
        workspace and warm sandbox of the pool."""
        if workspace_id is not None:
            ws = self._live.pop(workspace_id, None)
            if ws is not None:
                await self._dispose(ws)
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        for ws in list(self._live.values()):
            self._live.pop(ws.id, None)
            await self._dispose(ws)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for workers in self._warm.values():
            while workers:
                await self.pool._dispose(workers.popleft())
        self._warm.clear()

    async def prewarm(self, repository: str, commit: str = "") -> None:
        """Make the repository's base layer and start its warm sandboxes before any episode asks."""
        self._check_open()
        self._top_up(await self._base(repository, commit))

    async def wait_warm(self, repository: str, commit: str = "", timeout_s: float = 60.0) -> None:
        """Until the repository has warm_per_repository warm sandboxes (for benchmarks and tests)."""
        base = await self._base(repository, commit)
        deadline = time.monotonic() + timeout_s
        self._top_up(base)
        while len(self._warm.get(base, ())) < self.config.warm_per_repository:
            if time.monotonic() > deadline:
                raise SandboxError(f"{repository}: no warm workspace sandbox after {timeout_s:g} s")
            self._top_up(base)
            await asyncio.sleep(0.005)

    async def usage(self, workspace_id: str) -> dict[str, int]:
        """Bytes and inodes the workspace's episode has written (its upper layer)."""
        ws = self._get(workspace_id)
        async with ws.lock:
            return await ws.worker.request({"op": "usage"})

    def stats(self) -> dict[str, Any]:
        return {
            "live": len(self._live),
            "warm": {repo: len(workers) for repo, workers in self._warm.items()},
            "opened": self.opened,
            "warm_hits": self.warm_hits,
            "forks": self.forks,
        }

    # -- internals -----------------------------------------------------------------------------------

    @property
    def layers(self) -> LayerStore:
        """The pool's layer directory, made on first use (a pool that refuses to run code has none)."""
        if self._layers is None:
            self._layers = LayerStore(Path(self.pool._dir) / "layers")
        return self._layers

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the workspace pool is closed")
        if self.pool.unavailable:
            from services.environment_sandbox.sandbox.job import SandboxUnavailable

            raise SandboxUnavailable(self.pool.unavailable)

    def _get(self, workspace_id: str) -> _Workspace:
        ws = self._live.get(workspace_id)
        if ws is None:
            raise WorkspaceError(
                f"workspace {workspace_id!r}: no such live workspace (closed or never opened)"
            )
        return ws

    async def _base(self, repository: str, commit: str) -> str:
        key = f"{repository}\0{commit}"
        lock = self._base_locks.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent first episodes of a repository copy it once
            return await asyncio.to_thread(self.layers.base, repository, commit)

    async def _runtime_dir(self) -> Path:
        async with self._runtime_lock:
            if self._runtime is None:
                root = Path(self.pool._dir).parent
                self._runtime = await asyncio.to_thread(
                    build_runtime, root, tuple(self.config.runtime_packages), self.pool.config.python
                )
            return self._runtime

    async def _spawn(self, lowers: list[str], tests: str = "") -> _Worker:
        worker = await self.pool._spawn(
            {
                "runtime_dir": str(await self._runtime_dir()),
                "layers_dir": str(self.layers.directory),
                "lowers": lowers,
                "disk_bytes": self.config.disk_bytes,
                "disk_inodes": self.config.disk_inodes,
            }
        )
        if tests:
            try:
                await worker.request({"op": "mount", "lowers": lowers, "tests": tests})
            except BaseException:
                await self.pool._dispose(worker)
                raise
        return worker

    def _register(
        self,
        repo: str,
        lowers: list[str],
        agent_layers: list[str],
        worker: _Worker,
        deadline: float,
        holds_slot: bool,
    ) -> _Workspace:
        cpu = worker.cgroup.cpu_usage_s() if worker.cgroup is not None else 0.0
        ws = _Workspace(uuid.uuid4().hex[:16], repo, lowers, agent_layers, worker, deadline, cpu, holds_slot)
        self.layers.acquire(lowers)
        self._live[ws.id] = ws
        LIVE.set(len(self._live))
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap_expired())
        return ws

    async def _dispose(self, ws: _Workspace) -> None:
        LIVE.set(len(self._live))
        try:
            await self.pool._dispose(ws.worker)
        finally:
            await asyncio.to_thread(self.layers.release, ws.lowers)
            if ws.holds_slot:
                self._slots.release()

    def _take_warm(self, repo: str) -> _Worker | None:
        workers = self._warm.get(repo)
        while workers:
            worker = workers.popleft()
            if worker.proc.returncode is None:
                self._warm.move_to_end(repo)
                return worker
            self._background(self.pool._dispose(worker))
        return None

    def _top_up(self, repo: str) -> None:
        """Start sandboxes for the repository until it has warm_per_repository, giving up the least
        recently used repositories' ones past max_warm."""
        cfg = self.config
        self._warm.setdefault(repo, deque())
        self._warm.move_to_end(repo)
        missing = cfg.warm_per_repository - len(self._warm[repo]) - self._warming.get(repo, 0)
        for _ in range(max(0, missing)):
            if self._closed or self.pool.unavailable:
                return
            self._warming[repo] = self._warming.get(repo, 0) + 1
            self._background(self._warm_one(repo))

    async def _warm_one(self, repo: str) -> None:
        try:
            worker = await self._spawn([repo])
        except Exception:
            log.exception("a warm workspace sandbox for %s failed to start", repo)
            return
        finally:
            self._warming[repo] -= 1
        if self._closed:
            await self.pool._dispose(worker)
            return
        self._warm.setdefault(repo, deque()).append(worker)
        while sum(len(w) for w in self._warm.values()) > self.config.max_warm:
            oldest = next(r for r, w in self._warm.items() if w)
            await self.pool._dispose(self._warm[oldest].popleft())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_expired(self) -> None:
        """Close workspaces past their wall clock (plus a grace for the episode to score): an episode
        that died without closing its workspace frees it here."""
        while not self._closed:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for ws in [w for w in self._live.values() if w.deadline + REAP_GRACE_S < now]:
                log.warning("closing workspace %s: its episode's wall clock ran out", ws.id)
                with contextlib.suppress(Exception):
                    await self.close(ws.id)
