"""Each run's own deployments: started from its record in the KV bucket "runs", freed when it ends.

The watch delivers every record's current value first, so a restarted router starts the active
runs' deployments again (its old replicas died with it) and frees nothing it did not start.

- pending / running / stalled: the recipe's [[deployments]] start through the DeploymentManager like
  static ones, named `<run id>/<name>` (run_deployment_name) and serving only that run; weight-sync
  registers their replicas for the run and delivers its versions (version 0 first).
- completed / failed / stopped, or the record deleted: the run's replicas are killed, its deployments
  leave routing and ListDeployments, and weight-sync forgets their targets.
- queued: waiting for its turn; nothing starts.

Runs start side by side (one task each) so one run's slow replicas never hold up another's, and a
run that ends while it starts is cancelled and cleaned up. A run whose deployments cannot start is
reported to it as fatal: its requests fail with the reason rather than fall back to other weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.inference_router.deployments import DeploymentManager, replica_name
from services.inference_router.router import Router
from services.kit.bus import subjects
from services.kit.config.recipe import DeploymentSpec, ModelSection, RunRecord, run_deployment_name
from services.kit.messages.run_errors import describe

if TYPE_CHECKING:
    from services.kit.bus.client import Bus

log = logging.getLogger("looprl.inference_router.runs")

SERVED_STATES = frozenset({"pending", "running", "stalled"})
FINAL_STATES = frozenset({"completed", "failed", "stopped"})


def run_specs(
    run_id: str, specs: list[DeploymentSpec], model: ModelSection | None = None
) -> list[DeploymentSpec]:
    """The recipe's deployments as the router serves them for `run_id`: named `<run id>/<name>`. A
    LoRA run's load its base (`model.path`, unless a deployment names its own) and serve at least
    its adapter (`max_loras` >= 1)."""
    out = []
    for spec in specs:
        update: dict[str, object] = {"name": run_deployment_name(run_id, spec.name)}
        if model is not None and model.lora is not None:
            update["model_path"] = spec.model_path or model.path
            update["max_loras"] = max(1, spec.max_loras)
        out.append(spec.model_copy(update=update))
    return out


class RunDeployments:
    """Follows the run records and starts and frees each run's deployments."""

    def __init__(
        self,
        manager: DeploymentManager,
        router: Router,
        connect: Callable[[], None] | None = None,
        ready_timeout_s: float = 120.0,
        retry_s: float = 2.0,
    ) -> None:
        """`connect`: joins Ray (blocking), called before the first run's replicas start;
        `retry_s`: how often to look for the runs bucket until the gateway created it."""
        self.manager = manager
        self.router = router
        self.ready_timeout_s = ready_timeout_s
        self.retry_s = retry_s
        self._connect = connect
        self.served: dict[str, list[DeploymentSpec]] = {}  # run id -> its deployments (scoped)
        self._starts: dict[str, asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._watch_task: asyncio.Task | None = None
        self._watch: Any = None

    async def start(self, bus: Bus) -> None:
        """Watch the run records on `bus` (in the background: the bucket may not exist yet)."""
        self._watch_task = asyncio.create_task(self._follow(bus), name="router-runs-watch")

    async def _follow(self, bus: Bus) -> None:
        from services.kit.bus.client import BusError

        while True:
            try:
                kv = await bus.kv(subjects.RUNS)
                break
            except BusError as exc:  # the gateway creates it: look again
                log.info("not serving runs yet: %s", exc)
                await asyncio.sleep(self.retry_s)
        self._watch = kv.watch("*")  # run records only: history chunks are `<run>.history.<n>`
        await self._watch.start()
        log.info("serving the runs recorded in KV %r", subjects.RUNS)
        async for entry in self._watch:
            try:
                if entry.deleted:
                    await self.release(entry.key)
                    continue
                record = RunRecord.from_json(entry.value)
                if record.state in SERVED_STATES:
                    self.serve(record)
                elif record.state in FINAL_STATES:
                    await self.release(record.run_id)
            except Exception as exc:  # one bad record must not stop the watch
                log.warning("runs/%s: cannot serve this run: %s", entry.key, exc)

    def serve(self, record: RunRecord) -> None:
        """Start the run's deployments unless they are started or starting."""
        run_id = record.run_id
        if run_id in self.served or run_id == self.manager.config.run_id:
            return  # already ours, or the static deployments are this run's
        recipe = record.recipe()
        specs = run_specs(run_id, list(recipe.deployments), recipe.model)
        self.served[run_id] = specs
        self.router.runs.begin(run_id, [s.name for s in specs])
        self.router.notify()
        self._starts[run_id] = asyncio.create_task(self._start(run_id, specs), name=f"router-run-{run_id}")

    async def _start(self, run_id: str, specs: list[DeploymentSpec]) -> None:
        async with self._lock(run_id):
            try:
                if self._connect is not None:
                    await asyncio.to_thread(self._connect)  # joins once per process (connect_ray)
                for i, spec in enumerate(specs):
                    await self.manager.start(
                        spec, ready_timeout_s=self.ready_timeout_s, where=f"deployments[{i}]", run_id=run_id
                    )
                    log.info(
                        "run %s: deployment %s started with %d replica(s)", run_id, spec.name, spec.replicas
                    )
                self.router.runs.started(run_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = describe(exc)
                log.error("run %s: its deployments could not start: %s", run_id, why)
                await self._free(run_id, specs)
                self.router.runs.fail(run_id, why)
                if self.router.report_to_run is not None:
                    await self.router.report_to_run(
                        run_id, f"inference-router: the run's deployments could not start: {why}", fatal=True
                    )
            finally:
                self.router.notify()

    async def release(self, run_id: str) -> None:
        """Free everything started for `run_id` (nothing when it started nothing here)."""
        specs = self.served.pop(run_id, None)
        task = self._starts.pop(run_id, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if specs is None:
            return
        async with self._lock(run_id):
            await self._free(run_id, specs)
            self.router.runs.forget(run_id)
            self.router.notify()
        self._locks.pop(run_id, None)
        log.info("run %s ended: its deployments are freed", run_id)

    async def _free(self, run_id: str, specs: list[DeploymentSpec]) -> None:
        targets: list[str] = []
        for spec in specs:
            replicas = [replica_name(spec.name, i) for i in range(spec.replicas)]
            removed = await self.manager.remove(spec.name, replicas)
            targets += removed or ([spec.name] if spec.canary else replicas)
        await self.manager.unregister_targets(targets)

    def _lock(self, run_id: str) -> asyncio.Lock:
        return self._locks.setdefault(run_id, asyncio.Lock())

    async def stop(self) -> None:
        """Stop watching (the manager kills every replica when the service stops)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        for task in self._starts.values():
            task.cancel()
        for task in self._starts.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch.stop()
