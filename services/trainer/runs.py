"""TrainerApp: the runs the trainer process trains, one RunTrainer each (the servicer reports on them).

Each run has its own rank group (placement group and actors), optimizer, checkpoint folder and
weight pushes, so runs train side by side. With `run_ids` + `recipe` the trainer trains that one
run. Otherwise it follows the gateway's records in the KV bucket "runs": a run whose record is
pending, running or stalled is trained; a queued one starts nothing; one whose record leaves those
states (final, deleted, queued again) stops after its current step, writes its final checkpoint and
frees its ranks, while the other runs go on. SIGTERM stops every run the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from services.kit.bus import subjects
from services.kit.config.recipe import Recipe, RunRecord, load_recipe
from services.kit.config.service import bus_url
from services.kit.messages.run_errors import RunErrorReporter, describe
from services.kit.rpc.errors import FailedPrecondition
from services.trainer import metrics
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunTrainer

log = logging.getLogger("looprl.trainer")

# Record states whose run the trainer trains ("queued" waits for a slot: nothing may start for it).
ACTIVE_STATES = frozenset({"pending", "running", "stalled"})
# How many ended runs Status still reports; the earliest begun are forgotten first.
KEEP_ENDED = 16


class TrainerApp:
    def __init__(self, cfg: TrainerConfig, run_factory: Callable[..., RunTrainer] = RunTrainer) -> None:
        self.cfg = cfg
        self.bus = None
        self.runs: dict[str, RunTrainer] = {}
        """Every run this process holds, by run id, in the order they began (newest last)."""
        self._new_run = run_factory
        self._tasks: dict[str, asyncio.Task] = {}
        # The latest active record of each run (watch mode): what a run that stopped is begun again from
        # when its record returns to an active state.
        self._records: dict[str, RunRecord] = {}
        self._refused: set[str] = set()  # active runs that could not begin: not tried again per update
        self._reporter: RunErrorReporter | None = None
        self._reports: set[asyncio.Task] = set()
        self._watch_task: asyncio.Task | None = None
        self._stopping = False

    @property
    def run(self) -> RunTrainer | None:
        """The newest run: what a caller that names no run is told about."""
        return next(reversed(self.runs.values()), None)

    def live(self, run_id: str) -> bool:
        """Whether run `run_id` still holds its ranks (its loop has not returned)."""
        task = self._tasks.get(run_id)
        return task is not None and not task.done()

    async def start(self) -> None:
        from services.kit.ray.cluster import connect_ray

        await asyncio.to_thread(connect_ray, self.cfg.ray_address, "looprl-trainer")
        if self.cfg.nats_url:
            from services.kit.bus.client import Bus

            self.bus = await Bus.connect(bus_url(self.cfg), name="trainer")
            await self.bus.ensure_streams()
            self._reporter = RunErrorReporter(self.bus, "trainer")
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

    def begin(self, run_id: str, recipe: Recipe) -> RunTrainer:
        """Start training run `run_id` beside the runs already training."""
        if self._stopping:
            raise FailedPrecondition(f"run_id: the trainer is shutting down; not starting run {run_id!r}")
        if self.live(run_id):
            raise FailedPrecondition(f"run_id: already training run {run_id!r}")
        run = self._new_run(run_id, recipe, self.cfg, self.bus)
        self.runs.pop(run_id, None)  # an earlier run of this id ended: the new one is the newest
        self.runs[run_id] = run
        task = asyncio.create_task(run.run(), name=f"trainer-{run_id}")
        self._tasks[run_id] = task
        task.add_done_callback(lambda done: self._ended(run_id, done))
        log.info("run %s: training (%d runs held)", run_id, sum(self.live(r) for r in self._tasks))
        return run

    def on_record(self, run_id: str, record: RunRecord | None) -> None:
        """Run `run_id`'s record changed (None: deleted): start its run or stop it."""
        if record is None or record.state not in ACTIVE_STATES:
            self._records.pop(run_id, None)
            self._refused.discard(run_id)
            run = self.runs.get(run_id)
            if run is not None and self.live(run_id) and not run.stop_requested:
                log.info(
                    "run %s: record %s; stopping after the current step",
                    run_id,
                    "deleted" if record is None else f"is {record.state!r}",
                )
                run.request_stop()
            return
        self._records[run_id] = record
        self._reconcile(run_id)

    def _reconcile(self, run_id: str) -> None:
        """Begin the run when its record is active and no run of it is held or it was stopped."""
        record = self._records.get(run_id)
        if record is None or self._stopping or self.live(run_id) or run_id in self._refused:
            return
        held = self.runs.get(run_id)
        if held is not None and held.state != "stopped":
            # Completed or failed here: its record turns final next, and beginning it again would
            # train (or fail) it a second time.
            return
        try:
            self.begin(run_id, record.recipe())
        except Exception as exc:
            self._refuse(run_id, exc)

    def _refuse(self, run_id: str, exc: Exception) -> None:
        """Run `run_id` cannot begin here (its recipe, its id): the gateway fails it with the reason,
        rather than it waiting as running, and the runs beside it go on."""
        self._refused.add(run_id)
        log.warning("runs/%s: cannot train this run: %s", run_id, exc)
        if self._reporter is not None:
            report = self._reporter.report(
                run_id, f"the trainer cannot train this run: {describe(exc)}", fatal=True
            )
            task = asyncio.create_task(report, name=f"trainer-refuse-{run_id}")
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    def _ended(self, run_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(run_id) is task:  # not a run of this id begun since
            del self._tasks[run_id]
        # A run whose record is still active stays: its ended state is what keeps it from being
        # begun again until the gateway turns the record final.
        ended = [r for r in self.runs if not self.live(r) and r not in self._records]
        for old in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self.runs[old]
            metrics.forget_run(old)
        # Its record returned to an active state while it stopped: it resumes from its checkpoint.
        self._reconcile(run_id)

    async def _follow_runs(self, watch) -> None:
        async for entry in watch:
            try:
                self.on_record(entry.key, None if entry.deleted else RunRecord.from_json(entry.value))
            except Exception as exc:  # one bad record must not stop the watch
                log.warning("runs/%s: cannot train this run: %s", entry.key, exc)

    async def wait(self) -> None:
        """Until no run is training (runs begun meanwhile included)."""
        while tasks := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.gather(*tasks)

    async def stop(self) -> None:
        """Stop every run after its current step (final checkpoints, ranks freed), then the bus."""
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        for run in self.runs.values():
            run.request_stop()
        tasks = [*self._tasks.values(), *self._reports]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.bus is not None:
            await self.bus.drain()
