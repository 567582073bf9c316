"""PackerApp: the rollout-packer's bus connection and one RunPacker per active run.

Runs come from the KV bucket "runs" (the gateway's run records, recipe included) and/or from the
static `run_ids` + `recipe` settings. A run that reaches a terminal state stops being packed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord, load_recipe
from services.kit.config.service import bus_url
from services.rollout_packer.config import PackerConfig
from services.rollout_packer.run_packer import RunPacker
from services.rollout_packer.state import StepStore
from services.rollout_packer.step import PackerSettings, settings_from_recipe

log = logging.getLogger("looprl.rollout_packer")

TERMINAL_STATES = {"completed", "failed", "stopped"}


class PackerApp:
    def __init__(self, cfg: PackerConfig) -> None:
        self.cfg = cfg
        self.bus: Bus | None = None
        self.runs: dict[str, RunPacker] = {}
        self._watch_task: asyncio.Task | None = None
        self._retiring: set[str] = set()
        self._retire_tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()

    def lookup(self, run_id: str) -> RunPacker | None:
        return self.runs.get(run_id)

    def settings_for(self, recipe) -> PackerSettings:
        return settings_from_recipe(
            recipe,
            attention_weight=self.cfg.attention_weight,
            min_group_size=self.cfg.min_group_size,
            pad_token_id=self.cfg.pad_token_id,
        )

    async def start(self) -> None:
        self.bus = await Bus.connect(bus_url(self.cfg), name="rollout-packer")
        await self.bus.ensure_streams()
        if self.cfg.run_ids:
            if not self.cfg.recipe:
                raise ValueError("run_ids is set but recipe is empty: the packer needs the run's recipe")
            settings = self.settings_for(load_recipe(Path(self.cfg.recipe)))
            for run_id in (r.strip() for r in self.cfg.run_ids.split(",")):
                if run_id:
                    await self.add_run(run_id, settings)
        if self.cfg.watch_runs:
            kv = await self.bus.kv(subjects.RUNS)
            watch = kv.watch("*")  # run records only: history chunks are `<run>.history.<n>`
            await watch.start()
            self._watch_task = asyncio.create_task(self._follow_runs(watch), name="packer-runs-watch")

    async def add_run(self, run_id: str, settings: PackerSettings) -> RunPacker:
        assert self.bus is not None
        async with self._lock:
            if run_id in self.runs:
                return self.runs[run_id]
            store = StepStore(
                await self.bus.kv(subjects.PACKER_STEPS),
                run_id,
                self.cfg.keep_acked_steps,
                # a bus ack lost in a crash shows up as a redelivery one ack wait later
                settle_s=2 * self.cfg.ack_wait_s + 5,
            )
            packer = RunPacker(
                run_id,
                settings,
                self.bus,
                store,
                ack_wait_s=self.cfg.ack_wait_s,
                max_ack_pending=self.cfg.max_ack_pending,
                fetch_batch=self.cfg.fetch_batch,
            )
            await packer.start()
            self.runs[run_id] = packer
            return packer

    async def remove_run(self, run_id: str) -> None:
        async with self._lock:
            packer = self.runs.pop(run_id, None)
        if packer is not None:
            await packer.stop()
            log.info("run %s: no longer packed", run_id)

    def _retire(self, run_id: str) -> None:
        """Stop packing an ended run once the trainer acknowledged every step it was served.

        The trainer acks after its final checkpoint, which comes after the gateway already marked
        the run completed; dropping the run at once would leave those rollouts un-acked.
        """
        if run_id in self._retiring:
            return

        async def retire() -> None:
            deadline = asyncio.get_running_loop().time() + self.cfg.retire_grace_s
            while (packer := self.runs.get(run_id)) is not None and packer.has_unacked_steps:
                if asyncio.get_running_loop().time() > deadline:
                    log.warning("run %s ended with unacknowledged steps; they stay on the bus", run_id)
                    break
                await asyncio.sleep(0.5)
            await self.remove_run(run_id)
            self._retiring.discard(run_id)

        self._retiring.add(run_id)
        self._retire_tasks.append(asyncio.create_task(retire(), name=f"retire-{run_id}"))

    async def _follow_runs(self, watch) -> None:
        async for entry in watch:
            try:
                if entry.deleted:
                    await self.remove_run(entry.key)
                    continue
                record = RunRecord.from_json(entry.value)
                if record.state in TERMINAL_STATES:
                    self._retire(record.run_id)
                elif record.run_id not in self.runs:
                    await self.add_run(record.run_id, self.settings_for(record.recipe()))
            except Exception as exc:  # one bad record must not stop the others
                log.warning("runs/%s: cannot pack this run: %s", entry.key, exc)

    async def stop(self) -> None:
        for task in self._retire_tasks:
            task.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        for run_id in list(self.runs):
            await self.remove_run(run_id)
        if self.bus is not None:
            await self.bus.drain()
