"""Run control: the driver that feeds each run's episodes and keeps its record (gateway/run_store.py).

A RunDriver releases the episodes of trainer step s only while the newest trained version is
within the run's staleness bound (version >= s - max_staleness), so max_staleness = 0 is
synchronous on-policy and k > 0 overlaps generation with training; a synchronous run's next step
is fed ahead of its version once the packer has planned the step before it (`feed_horizon`). It
follows the run through the TRAIN and WEIGHTS streams and keeps the run record (KV bucket "runs")
up to date; a restarted gateway re-creates the drivers of running runs and continues where the
record says.
The driver also keeps the errors components report for the run and marks it stalled when it stops
progressing (gateway/stalls.py), replaces every group the packer drops whole with a newly sampled
one so that each step trains a full batch (gateway/resample.py), and copies the packer's sample
tables into the run.
Episode tasks carry deterministic message ids, so a feed repeated after a crash is deduped.

Tracing: a driver runs outside the CreateRun call that started it. The run's trace (the one
CreateRun was in, its traceparent kept in the record) holds the run's lifecycle only: driving
started, completed or failed. Each step's feed is its own small trace (a root span linked to the
run's trace, holding that step's task publishes), and each episode task starts its own trace in
the environment-sandbox, linked to its publish: no trace grows with the number of steps.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from gateway import metrics, resample
from gateway.evaluation import eval_versions, evaluate
from gateway.run_store import ACTIVE, EVALUATED_KEY, FINAL, LAST_EVALUATION_KEY, RunStore
from gateway.stalls import STALLED_KEY, ProgressClock, fail, follow_errors, watch_stalls
from gateway.task_code import DATASET_JSON_KEY, DATASET_KEY
from looprl.common.v1 import common_pb2
from looprl.environment.v1 import environment_pb2_grpc
from looprl.events.v1 import events_pb2
from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import BUS_UNAVAILABLE, Bus
from services.kit.bus.consumer import Consumer, Delivery
from services.kit.bus.kv import KV
from services.kit.config.recipe import Recipe, RunRecord, sampling_seed
from services.kit.messages import packer_reports, trainer_epochs
from services.kit.telemetry import tracing as telemetry

# Steps fed before their weight version exists. Their episodes wait at the router (bounded by its
# version_wait_s; past it they are redelivered) and start the moment the version lands, instead of
# after the trainer's step record has crossed NATS, the gateway, NATS again and the sandbox (a round
# trip bench/step_timeline.py shows in every synchronous step of the tiny recipe). It changes no
# sampling version: an episode's min_weight_version is still its step minus max_staleness.
FEED_AHEAD_STEPS = 1


def feed_horizon(trained: int, planned: int, max_staleness: int) -> int:
    """The last step whose episodes may be published, given the newest trained version and the
    newest step the packer planned (its batch complete and being served; -1 for none).

    Asynchronous runs feed FEED_AHEAD_STEPS past their staleness bound. A synchronous run feeds
    step `trained + 1` only once step `trained` is planned: its episodes then reach the replica
    while the trainer computes that step, on the core its one-threaded update leaves idle, instead of
    landing with the new version and slowing its staging and prefill (bench/step_timeline.py shows
    the phases of a step, bench/peer_trl.py the steps/s). A plan (even a forged or stale key) moves
    nothing past `trained + 1`, where the feed-ahead rule would be anyway; without plans it feeds
    at `trained`.
    """
    if max_staleness > 0:
        return trained + max_staleness + FEED_AHEAD_STEPS
    return trained + (1 if planned >= trained else 0)


# How long a finishing run waits for its followers to record the events already on the bus.
DRAIN_SECONDS = 5.0
# How often a run's record takes the packer's drop counts (Stats): a step record comes every ~0.1 s
# on the default recipe and the counts rarely move, while the call costs the gateway and the packer
# CPU at the moment the next step starts. A completed run takes them once more, so its record is exact.
DROPPED_REFRESH_S = 1.0

log = logging.getLogger("looprl.gateway.runs")


# Packer drop reasons that mark a redelivery of a rollout it already trained or holds, not a rollout.
DUPLICATE_REASONS = frozenset({"duplicate", "already_trained"})

# Key in RunRecord.extra holding the run's trace context (W3C headers).
RUN_TRACE_KEY = "trace"

_tracer = trace.get_tracer("looprl.gateway.runs")


def episode_tasks(record: RunRecord, recipe: Recipe, step: int) -> list[tuple[str, events_pb2.EpisodeTask]]:
    """The (msg_id, task) pairs of one trainer step: groups_per_step prompts x group_size samples
    (one forking task per group, or one task per sample)."""
    return [
        task
        for group in range(recipe.groups_per_step)
        for task in group_tasks(
            record, recipe, step, f"{record.run_id}.s{step}.g{group}", step * recipe.groups_per_step + group
        )
    ]


def group_tasks(
    record: RunRecord, recipe: Recipe, step: int, group_id: str, index: int
) -> list[tuple[str, events_pb2.EpisodeTask]]:
    """The (msg_id, task) pairs of one group of `step`: the run's `index`-th task, group_size samples."""
    tasks = []
    env = recipe.environment
    dataset_json = record.extra.get(DATASET_JSON_KEY, "")
    reward_config = json.dumps(recipe.reward.config) if recipe.reward.config else ""
    sampling = common_pb2.SamplingParams(
        temperature=recipe.sampling.temperature,
        top_p=recipe.sampling.top_p,
        top_k=recipe.sampling.top_k,
        max_tokens=recipe.sampling.max_tokens,
        n=1,
    )
    group_size = recipe.batch.group_size
    # Forked groups: one task per group, played to the first model turn once, then `group_size`
    # continuations share the prompt's prefill on one replica (EpisodeTask.branches).
    per_task = group_size if recipe.batch.fork_groups else 1
    for sample in range(group_size // per_task):
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.seed = sampling_seed(recipe.run.seed, index, sample)
        task = events_pb2.EpisodeTask(
            run_id=record.run_id,
            task_id=f"{group_id}.i{sample}",
            group_id=group_id,
            environment=env.name,
            # The environment resolves the prompt from its dataset by index and seed.
            task_json=json.dumps(
                {"index": index, "seed": recipe.run.seed, "split": "train"}
                if dataset_json
                else {"index": index, "seed": recipe.run.seed}
            ),
            group_size=group_size // per_task,
            sample_index=sample,
            sampling=params,
            min_weight_version=max(0, step - recipe.run.max_staleness),
            reward=recipe.reward_name,
            reward_config_json=reward_config,
            dataset_json=dataset_json,
            step=step,
            environment_config_json=json.dumps({**env.config, "max_turns": env.max_turns}),
            branches=per_task if per_task > 1 else 0,
            branch_at_turn=0,
            # The run's tokenizer travels with each task, so an environment serving several runs
            # renders each with its own chat template without reading run records.
            tokenizer=recipe.model.tokenizer,
        )
        tasks.append((task.task_id, task))
    return tasks


class RunDriver:
    """Feeds one run and follows its progress until it ends."""

    def __init__(
        self,
        bus: Bus,
        store: RunStore,
        run_id: str,
        packer: packer_pb2_grpc.RolloutPackerServiceStub | None = None,
        not_serving: Callable[[], Awaitable[list[str]]] | None = None,
        sandbox: environment_pb2_grpc.EnvironmentSandboxServiceStub | None = None,
    ) -> None:
        self.bus, self.store, self.run_id, self.packer = bus, store, run_id, packer
        self.sandbox = sandbox  # runs the evaluation episodes (RunEpisode)
        self.not_serving = not_serving  # the services of the run that are not serving, for stall reasons
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._feed_due = asyncio.Event()  # a new trained version or planned step: feed may go on
        # Newest trained version seen on the bus, ahead of the KV record that follows it: feeding
        # waits on it, and the next step's tasks go out before the accounting is written.
        self._trained_version = 0
        self._planned_step = -1  # newest step the packer planned (feed_horizon)
        # The groups the packer dropped whole, by the step that was filling (gateway/resample.py).
        self._drops: dict[int, list[packer_reports.GroupDrop]] = {}
        self._run_trace: dict[str, str] | None = None  # the run's trace context, from its record
        self.progress = ProgressClock()  # fed steps, trained steps and weight versions mark it
        self._epochs_kv: KV | None = None
        self._dropped_due = 0.0  # monotonic time the packer's drop counts are next asked for
        # Set when the run is finishing: the stream followers return at their first empty fetch.
        self._finishing = asyncio.Event()
        self._stream_followers: list[asyncio.Task] = []
        # Called with the run id when the driver ends with its run (completed, failed, or found
        # ended), not when it is stopped: the run manager then starts queued runs.
        self.on_end: Callable[[str], None] | None = None

    def start(self) -> None:
        # A context of its own: the driver's spans are not children of the RPC that started it.
        self._task = asyncio.create_task(
            self._main(), name=f"run-{self.run_id}", context=contextvars.Context()
        )
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and self.on_end is not None:
            self.on_end(self.run_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _main(self) -> None:
        self._stream_followers = [
            asyncio.create_task(self._keep("TRAIN follower", self._follow_train)),
            asyncio.create_task(self._keep("WEIGHTS follower", self._follow_weights)),
        ]
        followers = [
            *self._stream_followers,
            asyncio.create_task(
                self._keep(
                    "error follower", lambda: follow_errors(self.bus, self.store, self.run_id, self.changed)
                )
            ),
            asyncio.create_task(self._keep("stall watch", self._watch_stalls)),
            asyncio.create_task(self._keep("packer watch", self._follow_packer)),
        ]
        try:
            # nats-server restarting: feeding resumes from the record (fed_steps), and a step
            # published again is a JetStream duplicate of the same message ids.
            await self._keep("feeder", self._feed, retried=BUS_UNAVAILABLE)
        except Exception as exc:
            log.exception("run %s failed", self.run_id)
            error = f"gateway: {exc!r}"
            await self.store.update(self.run_id, lambda r, e=error: fail(r, e))
            self._lifecycle("run failed", error=error)
        finally:
            for task in followers:
                task.cancel()
            # Unwound before the driver counts as stopped: their consumers close before the bus drains.
            await asyncio.gather(*followers, return_exceptions=True)

    async def _keep(
        self,
        name: str,
        task: Callable[[], Awaitable[None]],
        retried: type[Exception] | tuple[type[Exception], ...] = Exception,
    ) -> None:
        """Run one of the driver's tasks until it returns, starting it again when it fails with one
        of `retried` (others propagate): one lost to a request cut by a nats-server restart would
        otherwise leave the run unrecorded, unfed and never marked stalled, without a word."""
        delay = 0.5
        while True:
            started = time.monotonic()
            try:
                return await task()
            except retried as exc:
                # Back off while it keeps failing; one that ran a while before failing starts over.
                delay = 0.5 if time.monotonic() - started > 60.0 else delay
                if isinstance(exc, BUS_UNAVAILABLE):
                    log.warning(
                        "run %s: the %s lost the bus (%r); again in %.1fs", self.run_id, name, exc, delay
                    )
                else:
                    log.exception("run %s: the %s failed; again in %.1fs", self.run_id, name, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)

    async def _watch_stalls(self) -> None:
        record = await self.store.get(self.run_id)
        if record is not None:
            stall_s = record.recipe().run.stall_seconds
            await watch_stalls(
                self.store, self.run_id, stall_s, self.progress, self.changed, self.not_serving
            )

    def _lifecycle(self, name: str, **attributes: object) -> None:
        """A moment of the run's life, as a short span in the run's own trace."""
        if self._run_trace is None:
            return
        with _tracer.start_as_current_span(
            name,
            context=telemetry.extract(self._run_trace),
            attributes={telemetry.ATTR.RUN_ID: self.run_id, **{k: str(v) for k, v in attributes.items()}},
        ):
            pass

    async def _publish_step(
        self, step: int, tasks: list[tuple[str, events_pb2.EpisodeTask]], name: str = "feed step"
    ) -> None:
        """One step's episode tasks, in a trace of their own linked to the run's."""
        run_ctx = telemetry.remote_span_context(self._run_trace)
        with _tracer.start_as_current_span(
            name,
            context=telemetry.new_trace(),
            links=[trace.Link(run_ctx)] if run_ctx is not None else [],
            attributes={
                telemetry.ATTR.RUN_ID: self.run_id,
                telemetry.ATTR.STEP: step,
                telemetry.ATTR.ROLLOUTS: sum(max(1, t.branches) for _, t in tasks),
            },
        ):
            subject = subjects.episodes(self.run_id)
            await asyncio.gather(*(self.bus.publish(subject, task, msg_id=mid) for mid, task in tasks))

    async def _resample(self, record: RunRecord, recipe: Recipe) -> RunRecord | None:
        """Feed a new group for each group the packer dropped whole, in order; the record as written,
        or None when nothing was owed. A step that needs more than the recipe allows fails the run."""
        why = resample.refusal(self._drops, recipe)
        if why is not None:
            record = await self.store.update(
                self.run_id, lambda r, e=why: fail(r, e) if r.state in ACTIVE else None
            )
            self._lifecycle("run failed", error=why)
            return record
        fed = int(record.extra.get(resample.RESAMPLED_KEY, 0))
        owed = resample.owed(self._drops, fed, recipe.run.steps)
        if not owed:
            return None
        for step, i in owed:
            group_id, index = resample.replacement(self.run_id, recipe, step, i)
            await self._publish_step(
                step, group_tasks(record, recipe, step, group_id, index), "resample group"
            )
        self.progress.mark()
        metrics.RESAMPLED_GROUPS.labels(self.run_id).inc(len(owed))
        total = fed + len(owed)
        return await self.store.update(self.run_id, lambda r, t=total: _resampled(r, t, recipe))

    async def _feed(self) -> None:
        record = await self.store.get(self.run_id)
        if record is None or record.state in FINAL:
            return
        recipe = record.recipe()
        self._run_trace = record.extra.get(RUN_TRACE_KEY) or None
        fed = int(record.extra.get("fed_steps", 0))
        if record.state == "pending":
            # Only a pending run starts: a StopRun that landed since the read above stays stopped.
            record = await self.store.update(self.run_id, _start)
            self._lifecycle("run started", steps=recipe.run.steps)
        else:
            self._lifecycle("run resumed", fed_steps=fed)
        evals = eval_versions(recipe)
        while True:
            if record is None or record.state not in ACTIVE:
                return
            trained = max(record.weight_version, self._trained_version)
            if recipe.eval.checkpoint_step >= 0:  # `looprl eval`: one evaluation, no training
                if not record.extra.get(EVALUATED_KEY):
                    record = await self._evaluate(record, recipe, 0, recipe.eval.checkpoint_step)
                await self.store.update(self.run_id, _complete)
                self._lifecycle("run completed", evaluated_step=recipe.eval.checkpoint_step)
                self.changed.set()
                return
            # The next version to evaluate: the feed holds before its step, so no later version can be
            # trained while the replicas serve it.
            done = record.extra.get(EVALUATED_KEY, ()) if evals else ()
            due = next((v for v in evals if v not in done), None)
            if due is not None and trained >= due:
                record = await self._evaluate(record, recipe, due, due)
                continue
            if record.weight_version >= recipe.run.steps:
                await self._drain_followers()
                dropped = await self._dropped(fresh=True)
                await self.store.update(self.run_id, lambda r, d=dropped: _complete(r, d))
                self._lifecycle("run completed", steps=record.weight_version)
                self.changed.set()
                return
            if self._drops:  # only a run whose packer dropped a group whole
                resampled = await self._resample(record, recipe)
                if resampled is not None:
                    record = resampled
                    self.changed.set()
                    continue
            horizon = feed_horizon(trained, self._planned_step, recipe.run.max_staleness)
            if due is not None:
                horizon = min(horizon, due - 1)
            if fed < recipe.run.steps and fed <= horizon:
                await self._publish_step(fed, episode_tasks(record, recipe, fed))
                self.progress.mark()
                fed += 1
                # The record as written: what the next pass decides on, without reading it back.
                record = await self.store.update(self.run_id, lambda r, f=fed: _fed(r, f, recipe))
                self.changed.set()
                continue
            self._feed_due.clear()
            try:
                await asyncio.wait_for(self._feed_due.wait(), timeout=1.0)
            except TimeoutError:
                pass
            record = await self.store.get(self.run_id)

    async def _evaluate(self, record: RunRecord, recipe: Recipe, version: int, step: int) -> RunRecord:
        """Evaluate weight `version` on the held-out split and record it as `step`'s evaluation."""
        if self.sandbox is None:
            raise RuntimeError(
                "eval: the gateway has no environment-sandbox address to run evaluation episodes"
            )
        figures = await evaluate(
            self.sandbox,
            record,
            recipe,
            version,
            step,
            record.extra.get(DATASET_JSON_KEY, ""),
            int(record.extra.get(DATASET_KEY, {}).get("eval_rows", 0)),
            on_episode=self.progress.mark,
        )
        self._lifecycle("run evaluated", step=step, pass_at_1=figures["pass_at_1"])
        log.info("run %s: evaluation of step %d: pass@1 %.3f", self.run_id, step, figures["pass_at_1"])
        await self.store.add_evaluation(self.run_id, len(record.extra.get(EVALUATED_KEY, ())), figures)
        record = await self.store.update(self.run_id, lambda r, f=figures: _evaluated(r, f))
        self.changed.set()
        return record

    async def _drain_followers(self) -> None:
        """Let the followers record what the bus already holds, so that a run reading COMPLETED holds
        every step and delivery published before it ended (the last version's may still follow)."""
        self._finishing.set()
        if self._stream_followers:
            await asyncio.wait(self._stream_followers, timeout=DRAIN_SECONDS)

    async def _fetch(self, consumer: Consumer) -> list[Delivery] | None:
        """The next deliveries; None once the run is finishing and nothing is left to read."""
        # One at a time: these streams carry a message or two a step, and a batched pull (16) was
        # seen to hold a lone step record until the next one came, a step late (bench/step_timeline:
        # step_record_lag_ms).
        deliveries = await consumer.fetch(batch=1, timeout=0.2 if self._finishing.is_set() else 1.0)
        if not deliveries and self._finishing.is_set():
            return None
        return deliveries

    async def _follow_train(self) -> None:
        consumer = await self.bus.pull_consumer(
            subjects.TRAIN, f"gateway-train-{self.run_id}", subjects.train(self.run_id), ack_wait=30
        )
        async with consumer:
            while (deliveries := await self._fetch(consumer)) is not None:
                for delivery in deliveries:
                    with delivery.process_span():
                        step = await delivery.parse_or_term(events_pb2.TrainStepRecord)
                        if step is None:
                            continue
                        if not await self._genuine(step):
                            log.warning(
                                "run %s: ignored the record of step %d of trainer epoch %r (not vouched for)",
                                self.run_id,
                                step.step,
                                step.trainer_epoch,
                            )
                            await self.store.update(self.run_id, _ignored)
                            await delivery.ack()
                            self.changed.set()
                            continue
                        self.progress.mark()
                        self._trained_version = max(self._trained_version, step.version)
                        self._feed_due.set()
                        dropped = await self._dropped()
                        # History and counters are each idempotent, so a crash between the two writes
                        # and the redelivery that follows leaves both right.
                        entry = history_entry(step, resample.per_step(self._drops, step.step))
                        await self.store.add_history(self.run_id, entry)
                        await self.store.update(
                            self.run_id, lambda r, s=step, d=dropped: _apply_step(r, s, d)
                        )
                        await delivery.ack()
                        self._feed_due.set()
                        self.changed.set()

    async def _follow_packer(self) -> None:
        """What the packer writes for this run: the newest step it planned (feed_horizon), the groups
        it dropped whole (replaced by `_resample`) and the sample tables (kept with the run)."""
        record = await self.store.get(self.run_id)
        every = record.recipe().logging.samples_every if record is not None else 0
        kv = await self.bus.kv(subjects.PACKER_STEPS)
        async with kv.watch(subjects.packer_run_keys(self.run_id)) as watch:
            async for entry in watch:
                kind = entry.key.split(".")[-2]
                step = packer_reports.key_step(entry.key)
                if entry.deleted or step is None:
                    continue
                if kind == "step" and step > self._planned_step:
                    self._planned_step = step
                    self._feed_due.set()
                elif kind == "drops":
                    self._drops[step] = packer_reports.parse_drops(entry.value)
                    self._feed_due.set()
                elif kind == "samples" and every:
                    try:
                        await self.store.add_samples(self.run_id, step, json.loads(entry.value), every)
                    except (
                        ValueError
                    ) as exc:  # its chunk past the server's max_payload (PayloadTooLarge), bad JSON
                        # A table must never hold up the run: the plans and drops after it still count.
                        log.warning(
                            "run %s: the samples table of step %d is not kept: %r", self.run_id, step, exc
                        )
                        continue
                    self.changed.set()

    async def _genuine(self, step: events_pb2.TrainStepRecord) -> bool:
        """Whether a trainer epoch vouches for the record, by the epochs as they are now (a cached
        list would miss the epoch that made an older one stale)."""
        if self._epochs_kv is None:
            self._epochs_kv = await self.bus.kv(subjects.TRAINER_EPOCHS)
        epochs = await trainer_epochs.read(self._epochs_kv, self.run_id)
        return trainer_epochs.vouches(epochs, step.trainer_epoch, step.step)

    async def _dropped(self, fresh: bool = False) -> dict[str, int] | None:
        """Rollouts the packer dropped for this run, by reason: None when it cannot be asked, or
        when it was asked less than DROPPED_REFRESH_S ago and `fresh` is not set."""
        now = time.monotonic()
        if self.packer is None or (now < self._dropped_due and not fresh):
            return None
        self._dropped_due = now + DROPPED_REFRESH_S
        try:
            stats = await self.packer.Stats(packer_pb2.StatsRequest(run_id=self.run_id), timeout=5)
        except Exception as exc:  # progress accounting must not stop the run
            log.warning("run %s: packer stats unavailable: %s", self.run_id, exc)
            return None
        return dict(stats.dropped)

    async def _follow_weights(self) -> None:
        consumer = await self.bus.pull_consumer(
            subjects.WEIGHTS, f"gateway-weights-{self.run_id}", subjects.weights(self.run_id), ack_wait=30
        )
        async with consumer:
            while (deliveries := await self._fetch(consumer)) is not None:
                for delivery in deliveries:
                    # WeightsRejected (a canary refused a version) shares the subject, told apart by header.
                    if (delivery.headers or {}).get(subjects.EVENT_HEADER) == subjects.WEIGHTS_REJECTED:
                        rejected = await delivery.parse_or_term(events_pb2.WeightsRejected)
                        if rejected is None:
                            continue
                        await self.store.update(self.run_id, lambda r, e=rejected: _apply_rejection(r, e))
                    else:
                        event = await delivery.parse_or_term(events_pb2.WeightsPublished)
                        if event is None:
                            continue
                        self.progress.mark()
                        await self.store.add_weight_sync(self.run_id, weight_sync_entry(event))
                        await self.store.update(self.run_id, lambda r, e=event: _apply_weights(r, e))
                    await delivery.ack()
                    self.changed.set()


def _evaluated(record: RunRecord, figures: dict) -> None:
    steps = record.extra.setdefault(EVALUATED_KEY, [])
    if figures["step"] not in steps:
        steps.append(figures["step"])
    record.extra[LAST_EVALUATION_KEY] = {k: figures[k] for k in ("step", "pass_at_1", "mean_reward")}


def _start(record: RunRecord) -> None:
    if record.state == "pending":
        record.state = "running"


def _ignored(record: RunRecord) -> None:
    record.extra["step_records_ignored"] = int(record.extra.get("step_records_ignored", 0)) + 1


def _published(record: RunRecord, recipe: Recipe) -> None:
    record.episodes_published = (
        int(record.extra.get("fed_steps", 0)) * recipe.batch.rollouts_per_step
        + int(record.extra.get(resample.RESAMPLED_KEY, 0)) * recipe.batch.group_size
    )


def _fed(record: RunRecord, fed_steps: int, recipe: Recipe) -> None:
    record.extra.pop(STALLED_KEY, None)
    record.extra["fed_steps"] = max(fed_steps, int(record.extra.get("fed_steps", 0)))
    _published(record, recipe)


def _resampled(record: RunRecord, total: int, recipe: Recipe) -> None:
    record.extra.pop(STALLED_KEY, None)
    record.extra[resample.RESAMPLED_KEY] = max(total, int(record.extra.get(resample.RESAMPLED_KEY, 0)))
    _published(record, recipe)


def history_entry(step: events_pb2.TrainStepRecord, resampled_groups: int = 0) -> dict:
    return {
        "step": step.step,
        "reward_mean": step.reward_mean,
        "reward_std": step.reward_std,
        "loss": step.loss,
        "mean_staleness": step.mean_staleness,
        "max_staleness": step.max_staleness,
        "train_tokens_per_second": step.tokens_per_second,
        "num_rollouts": step.num_rollouts,
        "num_tokens": step.num_tokens,
        "seconds": step.step_seconds,
        "clip_fraction": step.clip_fraction,
        "kl": step.kl,
        "entropy": step.entropy,
        "grad_norm": step.grad_norm,
        "mean_response_tokens": step.response_tokens / max(step.num_rollouts, 1),
        "importance_ratio_mean": step.importance_ratio_mean,
        "importance_ratio_max": step.importance_ratio_max,
        "importance_ratio_min": step.importance_ratio_min,
        "importance_ratio_clipped": step.importance_ratio_clipped,
        "at": time.time(),
        # Only where the step replaced groups (0 otherwise: every step entry is rewritten with its chunk).
        **({"resampled_groups": resampled_groups} if resampled_groups else {}),
    }


def weight_sync_entry(event: events_pb2.WeightsPublished) -> dict:
    return {
        "deployment": event.deployment,
        "version": event.version,
        "sync_seconds": event.sync_seconds,
        "bytes": event.bytes,
    }


def _apply_dropped(record: RunRecord, dropped: dict[str, int] | None) -> None:
    if dropped is not None:
        record.extra["dropped"] = {k: v for k, v in dropped.items() if k not in DUPLICATE_REASONS}
        record.extra["duplicate_deliveries"] = sum(v for k, v in dropped.items() if k in DUPLICATE_REASONS)


def _apply_step(record: RunRecord, step: events_pb2.TrainStepRecord, dropped: dict[str, int] | None) -> None:
    _apply_dropped(record, dropped)
    # Steps already counted, as merged [first, last] ranges (one range when steps arrive in order).
    counted: list[list[int]] = record.extra.setdefault("counted_steps", [])
    if any(lo <= step.step <= hi for lo, hi in counted):
        return  # a redelivered record: already counted
    counted.append([step.step, step.step])
    counted.sort()
    merged = [counted[0]]
    for lo, hi in counted[1:]:
        if lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    record.extra["counted_steps"] = merged
    record.extra.pop(STALLED_KEY, None)
    record.extra["rollouts_trained"] = int(record.extra.get("rollouts_trained", 0)) + step.num_rollouts
    record.step = max(record.step, step.step + 1)
    record.weight_version = max(record.weight_version, step.version)


def _apply_weights(record: RunRecord, event: events_pb2.WeightsPublished) -> None:
    record.extra.pop(STALLED_KEY, None)
    versions = record.extra.setdefault("deployments", {})
    versions[event.deployment] = max(int(versions.get(event.deployment, -1)), event.version)


def _apply_rejection(record: RunRecord, event: events_pb2.WeightsRejected) -> None:
    rejected = record.extra.setdefault("rejected_versions", {}).setdefault(event.deployment, [])
    if not any(r["version"] == event.version for r in rejected):
        rejected.append({"version": event.version, "drift": event.drift, "detail": event.detail})


def _complete(record: RunRecord, dropped: dict[str, int] | None = None) -> None:
    _apply_dropped(record, dropped)
    record.state = "completed"
    record.extra["finished_at"] = time.time()
