"""TrainerApp: the run the trainer process trains (the servicer reports on it).

The trainer owns one policy, so it trains one run at a time: the run named by `run_ids` + `recipe`,
or the first active run in the KV bucket "runs" (the gateway's records). SIGTERM stops the loop
after the current step and writes a final checkpoint before the ranks go away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from services.kit import subjects
from services.kit.config import bus_url
from services.kit.errors import FailedPrecondition
from services.kit.recipe import RunRecord, load_recipe
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunTrainer

log = logging.getLogger("looprl.trainer")

ACTIVE_STATES = {"pending", "running"}


class TrainerApp:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.bus = None
        self.run: RunTrainer | None = None
        self._run_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def start(self) -> None:
        from services.kit.ray_utils import connect_ray

        await asyncio.to_thread(connect_ray, self.cfg.ray_address, "looprl-trainer")
        if self.cfg.nats_url:
            from services.kit.bus import Bus

            self.bus = await Bus.connect(bus_url(self.cfg), name="trainer")
            await self.bus.ensure_streams()
        if self.cfg.run_ids:
            if not self.cfg.recipe:
                raise ValueError("run_ids is set but recipe is empty: the trainer needs the run's recipe")
            run_id = self.cfg.run_ids.split(",")[0].strip()
            self.begin(run_id, load_recipe(Path(self.cfg.recipe)))
        elif self.cfg.watch_runs and self.bus is not None:
            kv = await self.bus.kv(subjects.RUNS)
            watch = kv.watch("*")  # run records only: history chunks are `<run>.history.<n>`
            await watch.start()
            self._watch_task = asyncio.create_task(self._follow_runs(watch), name="trainer-runs-watch")

    def begin(self, run_id: str, recipe) -> RunTrainer:
        if self.run is not None and self.run.state not in ("completed", "stopped", "failed"):
            raise FailedPrecondition(f"run_id: already training run {self.run.run_id!r}")
        self.run = RunTrainer(run_id, recipe, self.cfg, self.bus)
        self._run_task = asyncio.create_task(self.run.run(), name=f"trainer-{run_id}")
        return self.run

    async def _follow_runs(self, watch) -> None:
        async for entry in watch:
            try:
                if entry.deleted:
                    if self.run is not None and self.run.run_id == entry.key:
                        self.run.request_stop()
                    continue
                record = RunRecord.from_json(entry.value)
                current = self.run
                if current is not None and current.run_id == record.run_id:
                    if record.state not in ACTIVE_STATES:
                        current.request_stop()
                elif record.state in ACTIVE_STATES and (
                    current is None or current.state in ("completed", "stopped", "failed")
                ):
                    self.begin(record.run_id, record.recipe())
            except Exception as exc:  # one bad record must not stop the watch
                log.warning("runs/%s: cannot train this run: %s", entry.key, exc)

    async def wait(self) -> None:
        if self._run_task is not None:
            await self._run_task

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        if self.run is not None:
            self.run.request_stop()
        if self._run_task is not None:
            with contextlib.suppress(Exception):
                await self._run_task
        if self.bus is not None:
            await self.bus.drain()
