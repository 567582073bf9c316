"""A warm pool of sandbox worker processes and the one call that runs code in it.

Each worker (see worker.py) is started ahead of time: interpreter loaded, namespaces entered,
privileges dropped, limits set, waiting on a pipe. `execute` hands a job to a ready worker,
reads its output under a byte cap and a wall-clock deadline, kills the worker's PID namespace
when either runs out, deletes the workspace, and starts a replacement. A worker runs exactly one
job: nothing one program leaves behind (files, processes, modules, globals) reaches the next.

Each worker gets its own uid from a range, because RLIMIT_NPROC counts processes per uid: with
one shared uid a fork bomb in one sandbox would starve every other sandbox of processes. Each
worker also gets its own cgroup (cgroups.py): memory, pids and CPU are limited for the sandbox as
a whole, not per process.

The pool fails closed: with `isolation_level = "full"` (the default) a worker that could not
apply every mechanism in `isolation` (as root without CAP_SYS_ADMIN: no namespaces, no mounts) is
never used; the pool refuses to start and executions raise SandboxUnavailable (the service keeps
serving environments that run no code). Running with
whatever the host allows takes an explicit `isolation_level = "degraded"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from services.environment_sandbox.sandbox.cgroups import CgroupHost, CgroupUnavailable, SandboxCgroup
from services.environment_sandbox.sandbox.job import (
    ExecJob,
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    validate_files,
)
from services.environment_sandbox.sandbox.uids import UidBlock, sweep_dead_pools

log = logging.getLogger(__name__)

WORKER_SCRIPT = str(Path(__file__).with_name("worker.py"))
# Longest status line: a workspace command's reply carries its (capped, JSON-escaped) output.
STATUS_LINE_LIMIT = 32 << 20


class _Worker:
    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        job_fd: int,
        status: asyncio.StreamReader,
        workspace: Path,
        uid: int,
        transport: asyncio.BaseTransport,
        cgroup: SandboxCgroup | None,
    ) -> None:
        self.cgroup = cgroup
        self.proc = proc
        self.job_fd = job_fd
        self.status = status
        self.workspace = workspace
        self.uid = uid
        self.transport = transport
        self.init_pid = 0
        self.isolation: list[str] = []
        self.missing: list[str] = []
        self._requests = asyncio.Lock()

    async def request(self, payload: dict) -> dict:
        """One op to a workspace sandbox's init (workspace_init.py) and its reply; SandboxError when
        the sandbox is gone."""
        line = json.dumps(payload).encode() + b"\n"
        async with self._requests:
            if self.job_fd < 0:
                raise SandboxError("the workspace sandbox is closed")
            try:
                if len(line) < 32768:
                    _write_all(self.job_fd, line)
                else:
                    await asyncio.to_thread(_write_all, self.job_fd, line)
            except OSError as exc:
                raise SandboxError(f"the workspace sandbox is gone ({exc.strerror})") from None
            while True:
                raw = await self.status.readline()
                if not raw:
                    raise SandboxError("the workspace sandbox exited (killed, or out of memory)")
                kind, _, body = raw.decode(errors="replace").partition(" ")
                if kind == "reply":
                    reply = json.loads(body)
                    if not reply.pop("ok", False):
                        raise SandboxError(f"workspace op {payload.get('op')!r} failed: {reply.get('error')}")
                    return reply

    def kill(self) -> None:
        # The init is pid 1 of the sandbox's PID namespace: killing it kills everything inside,
        # and the outer process then reaps it and exits. Killing the outer too would orphan the
        # init to the host's pid 1; only without a PID namespace is the process group the handle.
        if self.init_pid and "pidns" in self.isolation:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.init_pid, signal.SIGKILL)
            return
        for pid in (self.init_pid, self.proc.pid):
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class SandboxPool:
    """Warm sandbox workers on this host. Use from one asyncio event loop."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        root = Path(self.config.root_dir or tempfile.gettempdir()) / "looprl-sandbox"
        root.mkdir(mode=0o711, exist_ok=True)
        sweep_dead_pools(root)
        self._dir = Path(tempfile.mkdtemp(prefix=f"pool-{os.getpid()}-", dir=root))
        self._dir.chmod(0o711)  # the sandbox uid must traverse it to reach its own workspace
        self._ready: asyncio.Queue[_Worker] = asyncio.Queue()
        self._uid_block = UidBlock(root, self.config.uid_base, self.config.uid_count)
        self._free_uids = list(self._uid_block.uids)
        self._seq = itertools.count()
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._spawning = 0
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self.waiting = 0
        self.running = 0
        self.completed = 0
        self.cold_starts = 0
        self.unavailable = ""  # why this pool refuses to run code; "" while it runs
        self.isolation: list[str] = []  # what the last started worker applied
        self.missing_isolation: list[str] = []
        self.cgroups: CgroupHost | None = None
        self._cgroup_error = ""
        self._workspaces = None
        if "cgroup" in self.config.isolation:
            try:
                self.cgroups = CgroupHost.open()
            except CgroupUnavailable as exc:
                self._cgroup_error = f"cgroup: {exc}"

    async def start(self) -> SandboxPool:
        """Start the warm workers; SandboxUnavailable when the configured isolation is not there."""
        try:
            self._ready.put_nowait(await self._spawn())  # the first one surfaces a refusal
            self._refill()
            await self.wait_warm()
        except BaseException:
            await self.close()
            raise
        return self

    async def wait_warm(self, timeout: float | None = None) -> None:
        """Until `warm_workers` workers are ready (for benchmarks and tests)."""
        deadline = time.monotonic() + (timeout or self.config.start_timeout_s * 2)
        while self._ready.qsize() < self.config.warm_workers:
            if self.unavailable:
                raise SandboxUnavailable(self.unavailable)
            if time.monotonic() > deadline:
                raise SandboxError(f"only {self._ready.qsize()} warm workers after waiting")
            self._refill()
            await asyncio.sleep(0.01)

    def stats(self) -> dict[str, int]:
        return {
            "warm": self._ready.qsize(),
            "spawning": self._spawning,
            "waiting": self.waiting,
            "running": self.running,
            "completed": self.completed,
            "cold_starts": self.cold_starts,
        }

    def isolation_status(self) -> dict:
        """The isolation level and mechanisms executions run under (for the service's status)."""
        cfg = self.config
        return {
            "level": cfg.isolation_level,
            "isolation": list(self.isolation),
            "missing_isolation": list(self.missing_isolation),
            "unavailable": self.unavailable,
            "cgroup": self.cgroups.name if self.cgroups else "",
            "memory_bytes": cfg.memory_bytes,
            "pids": cfg.pids,
            "cpu_quota": cfg.cpu_quota,
            "workspace_bytes": cfg.workspace_bytes,
        }

    @property
    def queue_depth(self) -> int:
        return self.waiting + self.running

    @property
    def sandbox_config(self) -> SandboxConfig:
        """The limits executions run under (the same name on SandboxFleet)."""
        return self.config

    async def execute(self, job: ExecJob) -> ExecResult:
        """Run one job; InvalidJob for bad input, SandboxUnavailable when the pool refuses to run."""
        validate_files(job.files)
        if self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            warm = not self._ready.empty()
            if warm:
                worker = self._ready.get_nowait()
            else:
                self.cold_starts += 1
                worker = await self._spawn()
            self._refill()
            try:
                return await self._run(worker, job, warm)
            finally:
                # The program has exited by now; deleting its workspace need not delay the answer.
                self._background(self._dispose(worker))
        finally:
            self.running -= 1
            self.completed += 1
            self._slots.release()

    async def run_code(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None, timeout_s: float = 0.0
    ) -> ExecResult:
        """The executor environments call (keyword arguments, no ExecJob import needed)."""
        return await self.execute(ExecJob(code, stdin, dict(files or {}), timeout_s))

    async def close(self) -> None:
        self._closed = True
        if self._workspaces is not None:
            await self._workspaces.close()
        while self._tasks:  # spawns finishing now dispose themselves; disposals finish
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        while not self._ready.empty():
            await self._dispose(self._ready.get_nowait())
        shutil.rmtree(self._dir, ignore_errors=True)
        self._uid_block.release()
        if self.cgroups is not None:
            self.cgroups.close()

    # -- internals ---------------------------------------------------------------------------------

    def _refill(self) -> None:
        missing = self.config.warm_workers - self._ready.qsize() - self._spawning
        for _ in range(max(0, missing)):
            if self._closed or self.unavailable:
                return
            self._spawning += 1
            self._background(self._spawn_into_pool())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn_into_pool(self) -> None:
        try:
            worker = await self._spawn()
        except SandboxUnavailable:
            return  # logged once, in _spawn
        except Exception:
            log.exception("sandbox worker failed to start")
            await asyncio.sleep(0.5)
            return
        finally:
            self._spawning -= 1
        if self._closed:
            await self._dispose(worker)
        else:
            self._ready.put_nowait(worker)

    @property
    def workspaces(self):
        """Repository workspaces on this pool's sandboxes (workspaces.py), made on first use."""
        if self._workspaces is None:
            from services.environment_sandbox.sandbox.workspaces import WorkspacePool

            self._workspaces = WorkspacePool(self)
        return self._workspaces

    async def _spawn(self, repository: dict | None = None) -> _Worker:
        """A started worker; with `repository` ({runtime_dir, layers_dir, lowers, disk_bytes,
        disk_inodes}) a workspace sandbox with that workspace mounted, under the workspace limits."""
        cfg = self.config
        ws = cfg.workspace
        if not self._free_uids:
            raise SandboxError("no free sandbox uid (uid_count too small for the pool)")
        uid = self._free_uids.pop(0)
        workspace = self._dir / f"w{next(self._seq)}-{uuid.uuid4().hex[:6]}"
        workspace.mkdir(mode=0o700)
        os.chown(workspace, uid, cfg.gid)
        cgroup, cgroup_error = None, self._cgroup_error
        if self.cgroups is not None:
            try:
                limits = (
                    (ws.memory_bytes, ws.pids, ws.cpu_quota)
                    if repository
                    else (cfg.memory_bytes, cfg.pids, cfg.cpu_quota)
                )
                cgroup = await asyncio.to_thread(self.cgroups.create, *limits)
            except OSError as exc:
                cgroup_error = f"cgroup: {exc}"
        job_r, job_w = os.pipe()
        status_r, status_w = os.pipe()
        args = {
            "job_fd": job_r,
            "status_fd": status_w,
            "workspace": str(workspace),
            "uid": uid,
            "gid": cfg.gid,
            "want": list(cfg.isolation),
            "cgroup_procs": cgroup.procs_files if cgroup else [],
            "cgroup_name": "cgroup",
            "workspace_bytes": cfg.workspace_bytes,
            "readonly_paths": list(cfg.readonly_paths),
            "limits": {
                "cpu_seconds": int(cfg.max_timeout_s) + 1,
                "memory_bytes": cfg.memory_bytes,
                "nproc": cfg.nproc,
                "fsize_bytes": cfg.fsize_bytes,
                "nofile": cfg.nofile,
            },
        }
        if repository:
            args["repository"] = repository
            # A command's own limits; the cgroup bounds the episode's processes together.
            args["limits"] = {
                "memory_bytes": ws.memory_bytes,
                "nproc": ws.pids,
                "fsize_bytes": ws.disk_bytes,
                "nofile": 1024,
            }
        loop = asyncio.get_running_loop()
        try:
            proc = await asyncio.create_subprocess_exec(
                cfg.python or sys.executable,
                "-I",
                "-S",
                WORKER_SCRIPT,
                json.dumps(args),
                stdin=asyncio.subprocess.DEVNULL,
                # A workspace's commands report through the status pipe; nothing reads this one.
                stdout=asyncio.subprocess.DEVNULL if repository else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(job_r, status_w),
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove(0)
            raise
        finally:
            os.close(job_r)
            os.close(status_w)
        reader = asyncio.StreamReader(limit=STATUS_LINE_LIMIT)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(status_r, "rb", buffering=0)
        )
        worker = _Worker(proc, job_w, reader, workspace, uid, transport, cgroup)
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                while True:
                    line = await reader.readline()
                    if not line:
                        err = (await proc.stderr.read())[-2000:].decode(errors="replace")
                        raise SandboxError(f"sandbox worker exited during start-up: {err}")
                    kind, _, payload = line.decode().partition(" ")
                    data = json.loads(payload)
                    if kind == "pid":
                        worker.init_pid = data["pid"]
                    elif kind == "error":
                        # Missing isolation is the likelier cause (e.g. an interpreter the sandbox
                        # uid can only reach through the private root): report it as such.
                        worker.missing = data.get("missing", []) + ([cgroup_error] if cgroup_error else [])
                        if worker.missing:
                            self._check_isolation(worker)
                        raise SandboxError(f"sandbox worker set-up failed: {data['error']}")
                    elif kind == "ready":
                        worker.isolation = data["isolation"]
                        worker.missing = data["missing"] + ([cgroup_error] if cgroup_error else [])
                        self._check_isolation(worker)
                        return worker
        except BaseException:
            await self._dispose(worker)
            raise

    def _check_isolation(self, worker: _Worker) -> None:
        self.isolation, self.missing_isolation = list(worker.isolation), list(worker.missing)
        if not worker.missing:
            return
        if self.config.isolation_level == "degraded":
            log.warning("sandbox isolation degraded (isolation_level = degraded): %s", worker.missing)
            return
        self.unavailable = (
            "sandbox isolation unavailable, refusing to run code: "
            + "; ".join(worker.missing)
            + " (namespaces, mounts and cgroups need root with CAP_SYS_ADMIN; to run with weaker "
            "isolation an operator sets isolation_level = 'degraded', for the service "
            "LOOPRL_ENV_SANDBOX__ISOLATION_LEVEL=degraded)"
        )
        log.error("%s", self.unavailable)
        raise SandboxUnavailable(self.unavailable)

    async def _run(self, worker: _Worker, job: ExecJob, warm: bool) -> ExecResult:
        cfg = self.config
        timeout = min(job.timeout_s or cfg.timeout_s, cfg.max_timeout_s)
        memory = min(job.memory_bytes or cfg.memory_bytes, cfg.memory_bytes)
        if worker.cgroup is not None and memory < cfg.memory_bytes:
            try:
                worker.cgroup.set_memory(memory)
            except OSError as exc:  # below what the waiting worker already holds: rlimits still apply
                log.warning("sandbox memory limit %d not set on the cgroup: %s", memory, exc)
        payload = json.dumps(
            {
                "code": job.code,
                "stdin": job.stdin,
                "files": job.files,
                "limits": {"cpu_seconds": int(timeout) + 1, "memory_bytes": memory},
            }
        ).encode()
        start = time.perf_counter()
        if len(payload) < 32768:  # fits the empty pipe's buffer: the write cannot block
            _write_and_close(worker.job_fd, payload)
        else:
            await asyncio.to_thread(_write_and_close, worker.job_fd, payload)
        worker.job_fd = -1
        budget = [cfg.max_output_bytes]
        truncated = asyncio.Event()
        out = asyncio.ensure_future(_read_capped(worker.proc.stdout, budget, truncated))
        err = asyncio.ensure_future(_read_capped(worker.proc.stderr, budget, truncated))
        timed_out = False
        done_task = asyncio.ensure_future(asyncio.gather(out, err, worker.proc.wait()))
        trunc_task = asyncio.ensure_future(truncated.wait())
        finished, _ = await asyncio.wait(
            {done_task, trunc_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        killed_reason = ""
        if done_task not in finished:
            if trunc_task in finished:
                killed_reason = "output"
            else:
                timed_out, killed_reason = True, "timeout"
            worker.kill()
        trunc_task.cancel()
        stdout, stderr, _ = await done_task
        wall = time.perf_counter() - start
        exit_info: dict = {}
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                while line := await worker.status.readline():
                    kind, _, body = line.decode().partition(" ")
                    if kind == "exit":
                        exit_info = json.loads(body)
        if "code" in exit_info:
            exit_code = exit_info["code"]
        elif "signal" in exit_info:
            exit_code = -exit_info["signal"]
            if not killed_reason:
                sig = exit_info["signal"]
                killed_reason = "cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal {sig}"
        else:
            exit_code = -signal.SIGKILL
        err_text = stderr.decode(errors="replace")
        if not killed_reason and exit_code != 0 and "MemoryError" in err_text[-4000:]:
            killed_reason = "memory"
        peak = worker.cgroup.peak_memory() if worker.cgroup else 0
        if worker.cgroup is not None and worker.cgroup.oom_kills() and killed_reason in ("", "cpu"):
            killed_reason = "memory"  # the cgroup's OOM killer (SIGKILL) ended a process
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout.decode(errors="replace"),
            stderr=err_text,
            timed_out=timed_out,
            killed_reason=killed_reason,
            wall_seconds=wall,
            output_truncated=truncated.is_set(),
            isolation=list(worker.isolation),
            missing_isolation=list(worker.missing),
            warm=warm,
            memory_peak_bytes=peak,
            cpu_throttled_seconds=worker.cgroup.cpu_throttled_s() if worker.cgroup else 0.0,
        )

    async def _dispose(self, worker: _Worker) -> None:
        worker.kill()
        if worker.job_fd >= 0:
            os.close(worker.job_fd)
            worker.job_fd = -1
        with contextlib.suppress(Exception):
            await asyncio.wait_for(worker.proc.wait(), 5.0)
        worker.transport.close()
        if worker.cgroup is not None:
            await asyncio.to_thread(worker.cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, worker.workspace, True)
        self._free_uids.append(worker.uid)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_and_close(fd: int, data: bytes) -> None:
    try:
        _write_all(fd, data)
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


async def _read_capped(stream: asyncio.StreamReader | None, budget: list[int], over: asyncio.Event) -> bytes:
    """Read until EOF, keeping at most the shared budget; set `over` once it is exceeded."""
    if stream is None:
        return b""
    kept = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(kept)
        take = min(len(chunk), budget[0])
        kept += chunk[:take]
        budget[0] -= take
        if take < len(chunk):
            # Keep draining (and discarding) until the killed worker's pipe closes: a paused
            # transport would never see EOF and the process would never be reaped.
            over.set()
