"""Which runs the trainer trains, from the gateway's run records, without Ray: a stand-in for
RunTrainer records what TrainerApp begins and stops; the servicer answers about each run."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import REGISTRY

from looprl.trainer.v1 import trainer_pb2
from services.kit.config.recipe import RunRecord, parse_recipe
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.trainer import metrics
from services.trainer import runs as runs_module
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunTrainer
from services.trainer.runs import TrainerApp
from services.trainer.servicer import TrainerServicer

RECIPE = '[run]\nname = "u"\nsteps = 3\n[model]\npreset = "tiny-qwen2"\n'


class FakeRun:
    """Trains until stopped (then "stopped"), or until the test ends it with `finish`; with
    `linger` a stop only asks, as a real run's does while it finishes its step."""

    def __init__(self, run_id, recipe, cfg, bus) -> None:
        self.run_id, self.recipe = run_id, recipe
        self.state, self.step, self.error = "idle", 0, ""
        self.world_size, self.last_loss, self.last_checkpoint = 2, 0.5, ""
        self.stop_requested = self.linger = False
        self.checkpoints = 0
        self._end: asyncio.Future = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        self.state = "training"
        self.state = await self._end

    def request_stop(self) -> None:
        self.stop_requested = True
        if not self.linger and not self._end.done():
            self._end.set_result("stopped")

    def finish(self, state: str) -> None:
        self._end.set_result(state)

    async def checkpoint(self, export_hf: bool = False) -> tuple[str, int, str]:
        self.checkpoints += 1
        return f"/ckpt/{self.run_id}", self.step, ""


class Reporter:
    def __init__(self) -> None:
        self.reports: list[tuple[str, str, bool]] = []

    async def report(self, run_id: str, message: str, fatal: bool = False) -> None:
        self.reports.append((run_id, message, fatal))


class Trainer:
    """A TrainerApp over FakeRuns; `begun` lists every run it began, in order (a run id in
    `broken` cannot begin, as a recipe the trainer cannot build would)."""

    def __init__(self) -> None:
        self.begun: list[FakeRun] = []
        self.broken: set[str] = set()
        self.reporter = Reporter()

        def factory(run_id, *args):
            if run_id in self.broken:
                raise ValueError(f"model.preset: cannot build {run_id}")
            run = FakeRun(run_id, *args)
            self.begun.append(run)
            return run

        self.app = TrainerApp(TrainerConfig(), run_factory=factory)
        self.app._reporter = self.reporter  # what start() connects to the bus

    def record(self, run_id: str, state: str | None) -> None:
        """The gateway writes run `run_id`'s record in `state` (None: deletes it)."""
        self.app.on_record(run_id, None if state is None else RunRecord(run_id, RECIPE, state=state))

    def started(self) -> list[str]:
        return [r.run_id for r in self.begun]

    def training(self) -> list[str]:
        return sorted(r for r in self.app.runs if self.app.live(r))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_queued_record_starts_nothing_until_it_turns_pending() -> None:
    t = Trainer()
    t.record("a", "queued")
    await settle()
    assert t.started() == [] and t.app.run is None
    t.record("a", "pending")
    await settle()
    assert t.started() == ["a"] and t.training() == ["a"]
    assert t.begun[0].recipe.run.steps == 3  # the run trains the record's recipe


async def test_every_active_record_gets_its_own_run_once() -> None:
    t = Trainer()
    t.record("a", "pending")
    t.record("b", "running")
    t.record("c", "stalled")
    for state in ("running", "running", "stalled", "running"):  # the gateway rewrites records often
        t.record("a", state)
    await settle()
    assert t.started() == ["a", "b", "c"] and t.training() == ["a", "b", "c"]
    assert t.app.run.run_id == "c"  # the newest, what a caller naming no run is told about


@pytest.mark.parametrize("final", ["completed", "failed", "stopped", None])
async def test_a_record_turning_final_or_deleted_stops_only_its_run(final: str | None) -> None:
    t = Trainer()
    t.record("a", "running")
    t.record("b", "running")
    await settle()
    t.record("a", final)
    await settle()
    a, b = t.begun
    assert a.stop_requested and a.state == "stopped"
    assert not b.stop_requested and t.training() == ["b"]
    assert t.started() == ["a", "b"]  # nothing begun again


async def test_a_run_stopped_by_its_record_resumes_once_the_record_is_active_again() -> None:
    t = Trainer()
    t.record("a", "running")
    await settle()
    first = t.begun[0]
    first.linger = True
    t.record("a", "queued")
    await settle()
    assert first.stop_requested
    t.record("a", "pending")  # while the first one still writes its final checkpoint
    await settle()
    assert t.started() == ["a"], "no second rank group for a run whose first one still runs"
    first.finish("stopped")
    await settle()
    assert t.started() == ["a", "a"] and t.training() == ["a"]
    assert t.app.runs["a"] is t.begun[1]


@pytest.mark.parametrize("ended", ["completed", "failed"])
async def test_a_run_that_ended_here_is_not_begun_again_by_a_later_update(ended: str) -> None:
    t = Trainer()
    t.record("a", "running")
    t.record("b", "running")
    await settle()
    t.begun[0].finish(ended)
    await settle()
    t.record("a", "running")  # the gateway has not turned it final yet
    await settle()
    assert t.started() == ["a", "b"] and t.training() == ["b"]
    assert t.app.runs["a"].state == ended


async def test_a_run_that_cannot_begin_is_reported_once_and_the_others_train() -> None:
    t = Trainer()
    t.broken.add("bad")
    for _ in range(3):  # the gateway rewrites the record: one refusal, not one per update
        t.record("bad", "running")
    t.record("good", "running")
    await settle()
    assert t.started() == ["good"] and t.training() == ["good"]
    assert t.reporter.reports == [
        ("bad", "the trainer cannot train this run: ValueError: model.preset: cannot build bad", True)
    ]


async def test_begin_refuses_a_run_already_training_and_allows_one_that_ended() -> None:
    t = Trainer()
    recipe = parse_recipe(RECIPE)
    t.app.begin("a", recipe)
    with pytest.raises(FailedPrecondition, match="run_id: already training run 'a'"):
        t.app.begin("a", recipe)
    t.begun[0].finish("completed")
    await t.app.wait()
    t.app.begin("a", recipe)  # e.g. more steps of a completed run, resuming from its checkpoint
    assert t.started() == ["a", "a"]


async def test_stop_stops_every_run_and_begins_no_more() -> None:
    t = Trainer()
    t.record("a", "running")
    t.record("b", "pending")
    await settle()
    await asyncio.wait_for(t.app.stop(), 5)
    assert all(r.stop_requested and r.state == "stopped" for r in t.begun)
    t.record("c", "pending")
    await settle()
    assert t.started() == ["a", "b"] and t.training() == []


async def test_only_the_newest_ended_runs_are_kept_with_their_metrics(monkeypatch) -> None:
    monkeypatch.setattr(runs_module, "KEEP_ENDED", 2)
    t = Trainer()
    for run_id in ("ka", "kb", "kc", "kd"):
        t.record(run_id, "running")
        metrics.LOSS.labels(run_id).set(1.5)
    await settle()
    for run_id in ("ka", "kb", "kc"):
        t.record(run_id, "completed")
    await settle()
    assert list(t.app.runs) == ["kb", "kc", "kd"]  # kd trains; kb and kc ended last

    def loss(run_id: str) -> float | None:
        return REGISTRY.get_sample_value("looprl_trainer_loss", {"run": run_id})

    assert loss("ka") is None and loss("kb") == loss("kd") == 1.5

    t.begun[3].finish("completed")  # kd trained all its steps; its record is still "running"
    await settle()
    assert list(t.app.runs) == ["kb", "kc", "kd"]
    t.record("kd", "running")
    await settle()
    assert t.started() == ["ka", "kb", "kc", "kd"], "a run that completed here is not trained again"


async def test_status_reports_the_named_run_or_the_newest_with_every_run() -> None:
    t = Trainer()
    servicer = TrainerServicer(t.app)
    assert (await servicer.Status(trainer_pb2.StatusRequest(), None)).state == "idle"
    t.record("a", "running")
    t.record("b", "running")
    await settle()
    t.begun[0].step = 7
    t.begun[1].finish("failed")
    t.begun[1].error = "boom"
    await settle()

    a = await servicer.Status(trainer_pb2.StatusRequest(run_id="a"), None)
    assert (a.run_id, a.step, a.weight_version, a.state, len(a.runs)) == ("a", 7, 7, "training", 0)
    every = await servicer.Status(trainer_pb2.StatusRequest(), None)
    assert (every.run_id, every.state, every.error) == ("b", "failed", "boom")
    assert [(r.run_id, r.state) for r in every.runs] == [("a", "training"), ("b", "failed")]
    with pytest.raises(NotFound, match=r"run_id: the trainer holds no run 'zz' \(it holds: a, b\)"):
        await servicer.Status(trainer_pb2.StatusRequest(run_id="zz"), None)


async def test_checkpoint_needs_a_run_id_when_several_runs_train() -> None:
    t = Trainer()
    servicer = TrainerServicer(t.app)
    with pytest.raises(FailedPrecondition, match="no run is training"):
        await servicer.Checkpoint(trainer_pb2.CheckpointRequest(), None)
    t.record("a", "running")
    await settle()
    assert (await servicer.Checkpoint(trainer_pb2.CheckpointRequest(), None)).path == "/ckpt/a"
    t.record("b", "running")
    await settle()
    with pytest.raises(InvalidArgument, match=r"run_id: 2 runs are training \(a, b\); name one"):
        await servicer.Checkpoint(trainer_pb2.CheckpointRequest(), None)
    reply = await servicer.Checkpoint(trainer_pb2.CheckpointRequest(run_id="b"), None)
    assert reply.path == "/ckpt/b" and [r.checkpoints for r in t.begun] == [1, 1]
    t.record("b", "stopped")
    await settle()
    with pytest.raises(FailedPrecondition, match="run 'b' is not training"):
        await servicer.Checkpoint(trainer_pb2.CheckpointRequest(run_id="b"), None)


async def test_a_runs_rank_calls_never_wait_for_a_thread_other_work_holds() -> None:
    """A step blocks (ray.get) while it waits for its batch; with several runs and the process's
    other blocking work sharing one pool of threads, a run would wait for a thread to call its ranks."""
    run = RunTrainer("r1", parse_recipe(RECIPE), TrainerConfig())
    release = threading.Event()
    loop = asyncio.get_running_loop()
    # Every thread of the default pool busy, as many runs' steps waiting for their batches were.
    busy = [loop.run_in_executor(None, release.wait, 30) for _ in range(64)]
    try:
        assert await asyncio.wait_for(run._ranks(lambda x: x + 1, 41), 5) == 42
    finally:
        release.set()
        await asyncio.gather(*busy)
        run._thread.shutdown()
