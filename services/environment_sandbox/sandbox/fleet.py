"""Sandbox workers as Ray actors, scaled between min and max by queue depth.

Each SandboxActor owns a warm SandboxPool on its node (the isolation is per worker process, the
actor is only where the pool lives); the SandboxFleet in the service process sends each
execution to the actor with the fewest executions in flight and lets the Autoscaler decide, from
the number waiting and running, how many actors there should be. The Ray part is deliberately
thin: routing and scaling are plain Python over handles, so they are tested like any class.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from services.environment_sandbox.config import FleetConfig
from services.environment_sandbox.sandbox.job import (
    ExecJob,
    ExecResult,
    SandboxConfig,
    SandboxUnavailable,
    validate_files,
)
from services.kit.autoscale import Autoscaler
from services.kit.metric_names import counter, gauge

ACTORS = gauge("looprl_sandbox_fleet_actors")
PEAK_ACTORS = gauge("looprl_sandbox_fleet_peak_actors")
EXECUTIONS = counter("looprl_sandbox_fleet_executions_total")


def sandbox_actor_class():
    import ray

    @ray.remote(num_cpus=0.25)
    class SandboxActor:
        def __init__(self, config: dict) -> None:
            self.config = SandboxConfig.model_validate(config)
            self.pool = None

        async def execute(self, job: dict) -> dict:
            from services.environment_sandbox.sandbox.pool import SandboxPool

            if self.pool is None:
                self.pool = await SandboxPool(self.config).start()
            return (await self.pool.execute(ExecJob(**job))).to_dict()

        async def stats(self) -> dict:
            return self.pool.stats() if self.pool else {}

        async def close(self) -> None:
            if self.pool is not None:
                await self.pool.close()

    return SandboxActor


class SandboxFleet:
    def __init__(
        self,
        config: FleetConfig,
        sandbox: SandboxConfig | None = None,
        make_actor: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.sandbox = sandbox or SandboxConfig()
        self.autoscaler = Autoscaler(
            config.min_actors, config.max_actors, config.target_queue_per_actor, config.scale_down_after_s
        )
        self._make = make_actor or (lambda: sandbox_actor_class().remote(self.sandbox.model_dump()))
        self._actors: list[list[Any]] = []  # [handle, in flight]
        self._waiting = 0
        self._task: asyncio.Task | None = None
        self.peak_actors = 0
        self._last: ExecResult | None = None
        self.unavailable = ""

    async def start(self) -> SandboxFleet:
        for _ in range(self.config.min_actors):
            self._add()
        self._task = asyncio.ensure_future(self._scale_loop())
        return self

    @property
    def sandbox_config(self) -> SandboxConfig:
        return self.sandbox

    @property
    def actors(self) -> int:
        return len(self._actors)

    @property
    def queue_depth(self) -> int:
        return self._waiting + sum(a[1] for a in self._actors)

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
            while not self._actors:
                await asyncio.sleep(0.01)
            slot = min(self._actors, key=lambda a: a[1])
            slot[1] += 1
        finally:
            self._waiting -= 1
        try:
            result = ExecResult(**await slot[0].execute.remote(asdict(job)))
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
            slot[1] -= 1

    async def run_code(self, code: str, stdin: str = "", files: dict | None = None, timeout_s: float = 0.0):
        return await self.execute(ExecJob(code, stdin, dict(files or {}), timeout_s))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        while self._actors:
            await self._retire(self._actors.pop()[0])
        ACTORS.set(0)

    def _add(self) -> None:
        self._actors.append([self._make(), 0])
        self.peak_actors = max(self.peak_actors, len(self._actors))
        ACTORS.set(len(self._actors))
        PEAK_ACTORS.set(self.peak_actors)

    async def _retire(self, handle: Any) -> None:
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.close.remote(), 10)
        with contextlib.suppress(Exception):
            ray.kill(handle)

    async def _scale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scale_interval_s)
            want = self.autoscaler.desired(len(self._actors), self.queue_depth)
            while len(self._actors) < want:
                self._add()
            if len(self._actors) > want:
                idle = [a for a in self._actors if a[1] == 0]
                if idle:
                    self._actors.remove(idle[-1])
                    ACTORS.set(len(self._actors))
                    await self._retire(idle[-1][0])
