"""Sandbox workers as Ray actors, scaled between min and max by queue depth.

Each SandboxActor owns a warm SandboxPool on its node (the isolation is per worker process, the
actor is only where the pool lives); the SandboxFleet in the service process sends each
execution to the actor with the fewest executions in flight, and its actors are an AutoscaledPool
(services/kit/ray/autoscaled_pool.py) scaled on the executions waiting and running. The Ray part is
deliberately thin: routing and scaling are plain Python over handles, so they are tested like any
class.

An actor takes executions only once Ray has placed and started it: until then it counts toward the
fleet's size but is not routed to, and an execution with no started actor waits at most
`actor_start_timeout_s` and fails with SandboxError (UNAVAILABLE) naming why, instead of waiting on
an actor a full cluster never places.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from services.environment_sandbox.config import FleetConfig
from services.environment_sandbox.sandbox.job import (
    ExecJob,
    ExecResult,
    InvalidJob,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    validate_files,
)
from services.environment_sandbox.sandbox.workspaces import WorkspaceError
from services.kit.ray.autoscale import Autoscaler
from services.kit.ray.autoscaled_pool import AutoscaledPool, Member
from services.kit.telemetry.metrics import counter, gauge

ACTORS = gauge("looprl_sandbox_fleet_actors")
PEAK_ACTORS = gauge("looprl_sandbox_fleet_peak_actors")
EXECUTIONS = counter("looprl_sandbox_fleet_executions_total")
ACTOR_CPUS = 0.25

log = logging.getLogger(__name__)


def sandbox_actor_class():
    import ray

    @ray.remote(num_cpus=ACTOR_CPUS)
    class SandboxActor:
        def __init__(self, config: dict) -> None:
            self.config = SandboxConfig.model_validate(config)
            self.pool = None
            self._starting = asyncio.Lock()

        async def execute(self, job: dict) -> dict:
            return (await (await self._pool()).execute(ExecJob(**job))).to_dict()

        async def _pool(self):
            from services.environment_sandbox.sandbox.pool import SandboxPool

            # Calls arrive concurrently: the first starts the pool, the others wait for that start
            # rather than each starting (and leaking) a pool of their own.
            async with self._starting:
                if self.pool is None:
                    self.pool = await SandboxPool(self.config).start()
            return self.pool

        async def workspace(self, method: str, *args: Any, **kwargs: Any) -> dict | None:
            """One call of the pool's WorkspacePool (open, run, fork, close, prewarm, usage)."""
            if method not in WORKSPACE_METHODS:
                raise InvalidJob(f"workspace method {method!r}: not one of {', '.join(WORKSPACE_METHODS)}")
            return await getattr((await self._pool()).workspaces, method)(*args, **kwargs)

        async def stats(self) -> dict:
            return self.pool.stats() if self.pool else {}

        async def close(self) -> None:
            if self.pool is not None:
                await self.pool.close()

    return SandboxActor


WORKSPACE_METHODS = ("open", "run", "fork", "close", "prewarm", "usage")


class FleetWorkspaces:
    """Repository workspaces over the fleet: an episode's workspace and its forks live on one actor
    (the host holding their layers), chosen at `open` among the started actors, preferring one that
    is already warm for the repository unless it is busier than the least loaded by more than
    target_queue_per_actor. A live workspace is work in flight on its actor: it counts as load and
    pins the actor (the pool retires only idle ones). The same calls as WorkspacePool."""

    def __init__(self, fleet: SandboxFleet) -> None:
        self.fleet = fleet
        self._where: dict[str, Member[Any]] = {}
        self._warm: dict[Member[Any], set[str]] = {}  # repositories each actor has opened

    async def open(self, repository: str, commit: str = "", episode_timeout_s: float = 0.0) -> dict:
        fleet = self.fleet
        fleet._waiting += 1
        try:
            least = await fleet._started_actor()
        finally:
            fleet._waiting -= 1
        for gone in [m for m in self._warm if m not in fleet.pool.members]:  # retired since
            del self._warm[gone]
        warm = [m for m in fleet.pool.members if m.started and repository in self._warm.get(m, ())]
        actor = min(warm, key=lambda m: m.in_flight) if warm else least
        if actor.in_flight > least.in_flight + fleet.config.target_queue_per_actor:
            actor = least
        actor.in_flight += 1  # counted from now: concurrent opens spread out
        try:
            opened = await _remote(
                actor.handle.workspace.remote("open", repository, commit, episode_timeout_s)
            )
        except BaseException:
            actor.in_flight -= 1
            raise
        self._warm.setdefault(actor, set()).add(repository)
        self._where[opened["id"]] = actor
        return opened

    async def run(self, workspace_id: str, *args: Any, **kwargs: Any) -> dict:
        return await self._call(workspace_id, "run", *args, **kwargs)

    async def usage(self, workspace_id: str) -> dict:
        return await self._call(workspace_id, "usage")

    async def fork(self, workspace_id: str, *args: Any, **kwargs: Any) -> dict:
        actor = self._actor(workspace_id)
        actor.in_flight += 1
        try:
            forked = await _remote(actor.handle.workspace.remote("fork", workspace_id, *args, **kwargs))
        except BaseException:
            actor.in_flight -= 1
            raise
        self._where[forked["id"]] = actor
        return forked

    async def close(self, workspace_id: str) -> None:
        actor = self._where.pop(workspace_id, None)
        if actor is None:
            return
        try:
            await _remote(actor.handle.workspace.remote("close", workspace_id))
        finally:
            actor.in_flight -= 1

    async def prewarm(self, repository: str, commit: str = "") -> None:
        await self.fleet._started_actor()
        for actor in [m for m in self.fleet.pool.members if m.started]:
            await _remote(actor.handle.workspace.remote("prewarm", repository, commit))
            self._warm.setdefault(actor, set()).add(repository)

    def _actor(self, workspace_id: str) -> Member[Any]:
        actor = self._where.get(workspace_id)
        if actor is None:
            raise WorkspaceError(
                f"workspace {workspace_id!r}: no such live workspace (closed or never opened)"
            )
        return actor

    async def _call(self, workspace_id: str, method: str, *args: Any, **kwargs: Any) -> dict:
        return await _remote(
            self._actor(workspace_id).handle.workspace.remote(method, workspace_id, *args, **kwargs)
        )


async def _remote(ref: Any) -> Any:
    """Await an actor call, raising the sandbox's own error (Ray wraps it) so callers see the
    same exceptions as with a local pool."""
    try:
        return await ref
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SandboxError | InvalidJob):
            raise cause from None
        raise


class SandboxFleet:
    def __init__(
        self,
        config: FleetConfig,
        sandbox: SandboxConfig | None = None,
        make_actor: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.sandbox = sandbox or SandboxConfig()
        self.pool: AutoscaledPool[Any] = AutoscaledPool(
            Autoscaler(
                config.min_actors, config.max_actors, config.target_queue_per_actor, config.scale_down_after_s
            ),
            make_actor or (lambda: sandbox_actor_class().remote(self.sandbox.model_dump())),
            _retire,
            lambda: self.queue_depth,
            config.scale_interval_s,
            on_add=lambda actor: self._background(self._await_start(actor)),
            on_size=_count_actors,
        )
        self._waiting = 0
        self._start_error = ""  # why the last actor failed to start; "" once one has started
        self._tasks: set[asyncio.Task] = set()
        self._last: ExecResult | None = None
        self.unavailable = ""
        self.workspaces = FleetWorkspaces(self)

    async def start(self) -> SandboxFleet:
        self.pool.start()
        return self

    @property
    def sandbox_config(self) -> SandboxConfig:
        return self.sandbox

    @property
    def actors(self) -> int:
        return len(self.pool)

    @property
    def peak_actors(self) -> int:
        return self.pool.peak

    @property
    def queue_depth(self) -> int:
        """Executions waiting and running plus live workspaces: what the autoscaler sizes the fleet by."""
        return self._waiting + sum(a.in_flight for a in self.pool.members)

    def isolation_status(self) -> dict:
        """The configured level and limits, and the mechanisms the last execution ran under."""
        cfg = self.sandbox
        return {
            "level": cfg.isolation_level,
            "isolation": list(self._last.isolation) if self._last else [],
            "missing_isolation": list(self._last.missing_isolation) if self._last else [],
            "unavailable": self.unavailable,
            "cgroup": "",
            "memory_bytes": cfg.memory_bytes,
            "pids": cfg.pids,
            "cpu_quota": cfg.cpu_quota,
            "workspace_bytes": cfg.workspace_bytes,
        }

    async def execute(self, job: ExecJob) -> ExecResult:
        validate_files(job.files)
        if self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        self._waiting += 1
        try:
            actor = await self._started_actor()
            actor.in_flight += 1
        finally:
            self._waiting -= 1
        try:
            result = ExecResult(**await actor.handle.execute.remote(asdict(job)))
        except Exception as exc:
            # Ray wraps the actor's exception; the original is its cause.
            cause = exc if isinstance(exc, SandboxUnavailable) else getattr(exc, "cause", None)
            if not isinstance(cause, SandboxUnavailable):
                raise
            self.unavailable = str(cause.args[0] if cause.args else cause)
            raise SandboxUnavailable(self.unavailable) from None
        else:
            EXECUTIONS.inc()
            self._last = result
            return result
        finally:
            actor.in_flight -= 1

    async def run_code(self, code: str, stdin: str = "", files: dict | None = None, timeout_s: float = 0.0):
        return await self.execute(ExecJob(code, stdin, dict(files or {}), timeout_s))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()

    async def _started_actor(self) -> Member[Any]:
        """The started actor with the fewest executions in flight, once there is one."""
        timeout = self.config.actor_start_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            actor = self.pool.least_loaded(started_only=True)
            if actor is not None:
                return actor
            if self._start_error:
                raise SandboxError(self._start_error)
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"no sandbox actor started within actor_start_timeout_s={timeout:g} s: Ray has "
                    f"not placed one (each needs {ACTOR_CPUS} CPU; is the cluster full?)"
                )
            await asyncio.sleep(0.01)

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_start(self, actor: Member[Any]) -> None:
        timeout = self.config.actor_start_timeout_s
        try:
            await asyncio.wait_for(actor.handle.__ray_ready__.remote(), timeout)
        except Exception as exc:
            reason = "Ray has not placed it" if isinstance(exc, TimeoutError) else repr(exc)
            self._start_error = (
                f"a sandbox actor did not start within actor_start_timeout_s={timeout:g} s ({reason})"
            )
            log.error("%s; retiring it", self._start_error)
            self.pool.discard(actor)  # the scale loop starts a replacement
            await _retire(actor.handle)
            return
        actor.started = True
        self._start_error = ""


async def _retire(handle: Any) -> None:
    import ray

    with contextlib.suppress(Exception):
        await asyncio.wait_for(handle.close.remote(), 10)
    with contextlib.suppress(Exception):
        ray.kill(handle)


def _count_actors(size: int, peak: int) -> None:
    ACTORS.set(size)
    PEAK_ACTORS.set(peak)
