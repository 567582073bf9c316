"""One run's packer: consumes its rollouts from the bus, plans steps, serves them, acks after training.

Bus contract (ROLLOUTS stream, durable pull consumer `packer-<run>`, explicit ack). A message
carries one Rollout or a RolloutGroup (kit/messages/rollouts.py); each rollout in it is handled as if
it had come alone, and the message is settled once none of its rollouts needs it any more:
- an invalid rollout is counted with its reason; a bare one is termed (never redelivered), one in a
  group leaves its message to the others' settlement. A rollout dropped by policy (stale, zero-signal
  group, straggler, duplicate, already trained) is counted and releases its message;
- every other rollout keeps its message unacked (alive with in_progress) until the trainer
  acknowledged the step that holds it (AckStep). A crash therefore loses nothing: unacked messages
  are redelivered and the step records in KV (state.py) say which step each rollout belongs to, or
  that it was already trained.

Steps: the first NextBatch of a step plans it from the oldest complete groups (FIFO), after the
staleness filter, once `prompts_per_step` groups are there; the plan is saved before it is served.
Every rank of the step is served from the same deterministic StepBatch. A group dropped whole (no
signal, too stale, a straggler) is recorded in KV before its rollouts are acked (reports.py): the
gateway feeds a new group for it, so the step still fills. Every `samples_every` steps the step's
first rollouts are recorded as a samples table.

Tracing: taking in a rollout is a CONSUMER span in the rollout's own trace (a child of its
publish); building a step is a "packer step" span linked to the publish of every rollout in it,
and the trainer gets each rollout's traceparent with its micro-batch so its step span links too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, deque

from opentelemetry import trace

from looprl.common.v1 import common_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus, PoisonMessage
from services.kit.bus.consumer import Consumer, Delivery, batch_process_span, by_producer
from services.kit.messages import rollouts as rollout_messages
from services.kit.messages.packer_reports import GroupDrop
from services.kit.rpc.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from services.kit.telemetry import tracing as telemetry
from services.kit.telemetry.metrics import observe
from services.rollout_packer import metrics
from services.rollout_packer.groups import Group, GroupCollector
from services.rollout_packer.reports import DroppedGroups, sample_row
from services.rollout_packer.sequences import DropReason, Rejected, TokenSequence, sequence_from_rollout
from services.rollout_packer.state import StepRecord, StepStore
from services.rollout_packer.step import PackerSettings, StepBatch, build_step, filter_stale, screen_group

log = logging.getLogger("looprl.rollout_packer")
_tracer = trace.get_tracer("looprl.rollout_packer")

# Longest a gauge (queue depth, pending groups, unacked steps) goes unrefreshed while the run is live.
# Counting the queue walks every held rollout, which between checkpoint acks is up to
# checkpoint_every steps of them: once per intake batch that was a large share of the packer's CPU
# (bench/step_cpu.py measures it per service).
GAUGE_REFRESH_S = 0.5

# Policy drops are acked (the message was fine, we chose not to train it); invalid rollouts are termed.
_INVALID = {
    DropReason.MALFORMED,
    DropReason.MISSING_ID,
    DropReason.RUN_MISMATCH,
    DropReason.INVALID_GROUP_SIZE,
    DropReason.LOGPROB_LENGTH_MISMATCH,
    DropReason.INVALID_LOGPROB,
    DropReason.INVALID_TOKEN,
    DropReason.NEGATIVE_VERSION,
    DropReason.EMPTY_COMPLETION,
    DropReason.TRAINABLE_FIRST_TOKEN,
    DropReason.NON_FINITE_REWARD,
    DropReason.TOO_LONG,
}


class RunPacker:
    def __init__(
        self,
        run_id: str,
        settings: PackerSettings,
        bus: Bus,
        store: StepStore,
        *,
        ack_wait_s: float = 10.0,
        max_ack_pending: int = 65536,
        fetch_batch: int = 256,
    ) -> None:
        self.run_id = subjects.validate_run_id(run_id)
        metrics.init_run(self.run_id)
        self.settings = settings
        self.bus = bus
        self.store = store
        self.ack_wait_s = ack_wait_s
        self.max_ack_pending = max_ack_pending
        self.fetch_batch = fetch_batch
        self.collector = GroupCollector(settings.straggler_timeout_s, settings.min_group_size)
        self.group_drops = DroppedGroups(store.kv, self.run_id)
        self._background: set[asyncio.Task] = set()  # sample tables being written
        self.ready: deque[Group] = deque()
        self.held: dict[str, Delivery] = {}  # rollout id -> its unsettled delivery
        # A RolloutGroup message -> the ids of its rollouts still needing it (settled when empty).
        self.owed: dict[Delivery, set[str]] = {}
        self.traceparents: dict[str, str] = {}  # rollout id -> its publish span (W3C traceparent)
        self.records: dict[int, StepRecord] = {}  # planned (and recently acked) steps
        self.plan_of: dict[str, int] = {}  # rollout id -> unacked planned step
        self.plan_groups: set[str] = set()
        self.plan_seqs: dict[str, TokenSequence] = {}
        self.trained: dict[str, int] = {}  # rollout id -> acked step (recent steps only)
        self.built: dict[int, StepBatch] = {}
        self._building: dict[int, asyncio.Task] = {}
        self.dropped: Counter[str] = Counter()
        self.acked_total = 0
        self.steps_planned = 0
        self.last_batch: StepBatch | None = None
        self._gauges_due = 0.0  # monotonic time the gauges are next refreshed
        self._changed = asyncio.Condition()
        self._plan_lock = asyncio.Lock()
        self._consumer: Consumer | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.records = await self.store.load()
        for record in self.records.values():
            self._register(record)
        await self.group_drops.load()
        self._consumer = await self.bus.pull_consumer(
            subjects.ROLLOUTS,
            f"packer-{self.run_id}",
            subjects.rollouts(self.run_id),
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
        )
        self._tasks = [
            asyncio.create_task(self._intake_loop(), name=f"packer-intake-{self.run_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"packer-heartbeat-{self.run_id}"),
        ]
        pending = [s for s, r in self.records.items() if not r.acked]
        log.info("run %s: packing (unacked planned steps %s)", self.run_id, pending or "none")

    async def stop(self, hand_back: bool = True) -> None:
        """Stop consuming; hand held rollouts back for immediate redelivery (their plans are in KV)."""
        self._closing = True
        intake, *others = self._tasks or [None]
        for task in others:
            task.cancel()
        if intake is not None:
            # let the intake finish the fetch it is in, so what that fetch brought ends up held
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(intake, timeout=5.0)
        for task in others:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._consumer is not None:
            # unsubscribe before the naks: a fetch cut short leaves its pull request on the server,
            # and while it has a subscriber the server hands the redeliveries straight back to it
            await self._consumer.close()
        if hand_back:
            for d in dict.fromkeys(self.held.values()):
                with contextlib.suppress(Exception):
                    await d.nak()
        self.held.clear()
        self.owed.clear()
        self.traceparents.clear()

    def _register(self, record: StepRecord) -> None:
        if record.acked:
            for rid in record.rollout_ids:
                self.trained[rid] = record.step
        else:
            for rid in record.rollout_ids:
                self.plan_of[rid] = record.step
        for gid in record.groups:
            self.plan_groups.add(gid)
            self.collector.close_group(gid)

    # ---- intake -----------------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        assert self._consumer is not None
        next_expiry = time.monotonic()
        while not self._closing:
            try:
                deliveries = await self._consumer.fetch(self.fetch_batch, timeout=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus reconnects by itself; keep trying
                log.warning("run %s: fetch failed: %s", self.run_id, exc)
                await asyncio.sleep(0.5)
                continue
            # One consumer span per producer span (a group's rollouts are published as a batch).
            for batch in by_producer(deliveries):
                with batch_process_span(batch, attributes={telemetry.ATTR.RUN_ID: self.run_id}) as span:
                    taken: list[str] = []
                    for d in batch:
                        try:
                            taken += await self._take(d)
                        except asyncio.CancelledError:
                            raise
                        except Exception:
                            log.exception(
                                "run %s: handling %r failed; it will be redelivered", self.run_id, d
                            )
                    if span.is_recording():
                        span.set_attribute(telemetry.ATTR.ROLLOUT_ID, ",".join(taken))
            if time.monotonic() >= next_expiry:
                await self._expire_stragglers()
                next_expiry = time.monotonic() + min(1.0, self.settings.straggler_timeout_s / 4)
            self._update_gauges()
            async with self._changed:
                self._changed.notify_all()

    async def _take(self, d: Delivery) -> list[str]:
        """Take in every rollout of one message; returns their ids."""
        try:
            rollouts = rollout_messages.rollouts_in(d)
        except PoisonMessage as exc:
            await self._drop(d, Rejected("", DropReason.MALFORMED, str(exc)))
            return []
        if not rollouts:  # only a RolloutGroup can be empty
            await self._drop(d, Rejected("", DropReason.MALFORMED, "a RolloutGroup without rollouts"))
            return []
        if rollout_messages.is_group(d.headers):
            self.owed[d] = {r.rollout_id for r in rollouts}
        for rollout in rollouts:
            await self._take_rollout(d, rollout)
        return [r.rollout_id for r in rollouts]

    async def _take_rollout(self, d: Delivery, rollout: common_pb2.Rollout) -> None:
        seq = sequence_from_rollout(
            rollout,
            max_tokens=self.settings.max_tokens_per_microbatch,
            default_group_size=self.settings.group_size,
            run_id=self.run_id,
        )
        if isinstance(seq, Rejected):
            await self._drop(d, seq)
            return
        rid = seq.rollout_id
        if rid in self.trained:
            step = self.trained[rid]
            await self._drop(d, Rejected(rid, DropReason.ALREADY_TRAINED, f"trained in step {step}"))
            await self._settled(step, rid)
            return
        held = self.held.get(rid)
        if held is not None:
            if held.stream_seq == d.stream_seq:  # a redelivery of the message we hold: keep the newest
                self._hold(rid, d)
            else:
                await self._drop(d, Rejected(rid, DropReason.DUPLICATE, "rollout_id: already held"))
            return
        if rid in self.plan_of:
            self._hold(rid, d)
            self.plan_seqs[rid] = seq
            return
        if seq.group_id in self.plan_groups:
            await self._drop(d, Rejected(rid, DropReason.LATE, f"group {seq.group_id} is in a planned step"))
            return
        rejected = self.collector.add(seq)
        if rejected is not None:
            await self._drop(d, rejected)
            return
        self._hold(rid, d)
        await self._screen(self.collector.take_ready())

    async def _settled(self, step: int, rid: str) -> None:
        """A trained rollout left pending on the bus by a crash came back and was acked."""
        record = self.records.get(step)
        if record is None or rid not in record.unsettled:
            return
        record.unsettled.remove(rid)
        if not record.unsettled:
            with contextlib.suppress(Exception):  # a stale list only delays forgetting the record
                await self.store.save(record)

    def _hold(self, rid: str, d: Delivery) -> None:
        previous = self.held.get(rid)
        if previous is not None and previous is not d:
            self._release(previous, rid)  # a redelivery replaces it: the server forgot that delivery
        self.held[rid] = d
        parent = d.headers.get("traceparent")
        if parent:
            self.traceparents[rid] = parent

    async def _screen(self, groups: list[Group]) -> None:
        for group in groups:
            if group.group_id in self.group_drops:
                # Dropped (and replaced) before this packer restarted; its redelivery trains nothing.
                await self._drop_many(self._dropped_again(group))
                continue
            kept, drops = screen_group(group, self.settings)
            if kept is None:
                await self._group_dropped(group.group_id, drops)
            await self._drop_many(drops)
            if kept is not None:
                self.ready.append(kept)

    def _dropped_again(self, group: Group) -> list[Rejected]:
        drop = next(d for ds in self.group_drops.by_step.values() for d in ds if d.group_id == group.group_id)
        detail = f"group {group.group_id} was dropped before: {drop.detail}"
        return [
            Rejected(m.rollout_id, DropReason(drop.reason), detail, group.group_id) for m in group.members
        ]

    @property
    def filling_step(self) -> int:
        """The step being filled: the one after the newest planned."""
        return max(self.records, default=-1) + 1

    async def _group_dropped(self, group_id: str, drops: list[Rejected], step: int | None = None) -> None:
        """Record a group dropped whole, before any of its rollouts is acked, so the gateway replaces it."""
        if not drops:
            return
        first = drops[0]
        drop = GroupDrop(group_id, first.reason.value, first.detail)
        if await self.group_drops.record(self.filling_step if step is None else step, drop):
            metrics.DROPPED_GROUPS.labels(self.run_id, drop.reason).inc()

    async def _expire_stragglers(self) -> None:
        partial, drops = self.collector.expire()
        for gid in dict.fromkeys(r.group_id for r in drops):
            await self._group_dropped(gid, [r for r in drops if r.group_id == gid])
        await self._drop_many(drops)
        await self._screen(self.collector.take_ready())
        if partial:
            log.info("run %s: %d straggling group(s) released partial", self.run_id, len(partial))

    def _release(self, d: Delivery, rid: str) -> bool:
        """`rid` no longer needs message `d`; True when nothing in it does (it may be settled)."""
        owed = self.owed.get(d)
        if owed is None:
            return True
        owed.discard(rid)
        if owed:
            return False
        del self.owed[d]
        return True

    async def _drop(self, d: Delivery, rejected: Rejected) -> None:
        self.dropped[rejected.reason.value] += 1
        metrics.DROPPED.labels(self.run_id, rejected.reason.value).inc()
        group = d in self.owed
        if self._release(d, rejected.rollout_id):
            if rejected.reason in _INVALID and not group:
                await d.term(f"{rejected.reason.value}: {rejected.detail}")
            else:
                await d.ack()
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("looprl.dropped", rejected.reason.value)
        if rejected.rollout_id and self.held.get(rejected.rollout_id) is d:
            del self.held[rejected.rollout_id]
            self.traceparents.pop(rejected.rollout_id, None)

    async def _drop_many(self, drops: list[Rejected]) -> None:
        for rejected in drops:
            d = self.held.get(rejected.rollout_id)
            if d is not None:
                await self._drop(d, rejected)

    async def _heartbeat_loop(self) -> None:
        # A delivery is refreshed at the first tick at which its timer is a tick old, so at most two
        # ticks (two thirds of ack_wait) after it started; a step's rollouts, acked within a step,
        # never need one.
        tick = max(0.2, self.ack_wait_s / 3)
        while not self._closing:
            await asyncio.sleep(tick)
            due = time.monotonic() - tick
            for d in [d for d in dict.fromkeys(self.held.values()) if d.timer_started <= due]:
                with contextlib.suppress(Exception):
                    await d.in_progress()

    # ---- steps ------------------------------------------------------------------------------------

    async def step_batch(
        self, step: int, world_size: int, trainer_version: int, timeout_s: float | None
    ) -> StepBatch:
        """The step's batch, planning it first when it is the next one; waits for rollouts."""
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        record = self.records.get(step)
        if record is not None and record.acked:
            raise FailedPrecondition(f"step: {step} was already acknowledged; its rollouts are trained")
        if record is None:
            record = await self._plan(step, world_size, trainer_version, deadline)
        if record.world_size != world_size:
            raise FailedPrecondition(
                f"world_size: step {step} was planned for {record.world_size} ranks, not {world_size}"
            )
        batch = self.built.get(step)
        if batch is None:
            await self._wait_for(lambda: all(r in self.plan_seqs for r in record.rollout_ids), deadline, step)
            task = self._building.get(step)
            if task is None:  # ranks arriving together share one build
                task = self._building[step] = asyncio.create_task(self._build(record))
                task.add_done_callback(lambda _t, s=step: self._building.pop(s, None))
            batch = await asyncio.shield(task)
        return batch

    async def _plan(
        self, step: int, world_size: int, trainer_version: int, deadline: float | None
    ) -> StepRecord:
        async with self._plan_lock:
            if step in self.records:
                return self.records[step]
            newest = max(self.records, default=None)
            if newest is not None and step < newest:
                raise FailedPrecondition(
                    f"step: {step} was never planned and steps up to {newest} already are; ask for {newest + 1}"
                )
            selected: list[Group] = []
            try:
                while len(selected) < self.settings.prompts_per_step:
                    await self._wait_for(lambda: bool(self.ready), deadline, step, selected)
                    group = self.ready.popleft()
                    kept, drops = filter_stale(group, trainer_version, self.settings)
                    if kept is None:
                        await self._group_dropped(group.group_id, drops, step)
                    await self._drop_many(drops)
                    if kept is not None:
                        selected.append(kept)
            except BaseException:
                self.ready.extendleft(reversed(selected))  # nothing is lost on a timeout
                raise
            record = StepRecord(
                step, trainer_version, world_size, {g.group_id: g.rollout_ids for g in selected}
            )
            try:
                await self.store.save(record)
            except Exception as exc:
                self.ready.extendleft(reversed(selected))
                raise Unavailable(f"cannot record the plan of step {step} in KV: {exc}") from exc
            for g in selected:
                for m in g.members:
                    self.plan_seqs[m.rollout_id] = m
            self.records[step] = record
            self._register(record)
            self.steps_planned += 1
            metrics.STEPS_PLANNED.labels(self.run_id).inc()
            self._update_gauges()
            return record

    async def _build(self, record: StepRecord) -> StepBatch:
        groups = [Group(gid, [self.plan_seqs[r] for r in rids]) for gid, rids in record.groups.items()]
        started = time.perf_counter()
        links, dropped = telemetry.link_carriers(
            [{"traceparent": self.traceparents.get(r, "")} for r in record.rollout_ids],
            limit=self.settings.prompts_per_step * self.settings.group_size,
        )
        with _tracer.start_as_current_span(
            "packer step",
            links=links,
            attributes={
                telemetry.ATTR.RUN_ID: self.run_id,
                telemetry.ATTR.STEP: record.step,
                telemetry.ATTR.WEIGHT_VERSION: record.trainer_version,
                telemetry.ATTR.ROLLOUTS: len(record.rollout_ids),
                telemetry.ATTR.LINKS_DROPPED: dropped,
            },
        ) as span:
            batch = await asyncio.to_thread(
                build_step, record.step, groups, record.trainer_version, self.settings, record.world_size
            )
            oldest = min((s.min_version for s in batch.sequences), default=record.trainer_version)
            if span.is_recording():
                span.set_attributes(
                    {
                        telemetry.ATTR.TOKENS: sum(s.length for s in batch.sequences),
                        telemetry.ATTR.STALENESS: record.trainer_version - oldest,
                    }
                )
            observe(metrics.PLAN_SECONDS.labels(self.run_id), time.perf_counter() - started)
        metrics.STALENESS.labels(self.run_id).set(record.trainer_version - oldest)
        every = self.settings.samples_every
        if every and record.step % every == 0:
            self._save_samples(record.step, batch)
        self.built[record.step] = batch
        self.last_batch = batch
        metrics.PADDING_FRACTION.labels(self.run_id).set(batch.plan.padding_fraction)
        metrics.RANK_IMBALANCE.labels(self.run_id).set(batch.plan.rank_imbalance)
        metrics.SYNC_IDLE.labels(self.run_id).set(batch.plan.sync_idle_fraction)
        return batch

    def _save_samples(self, step: int, batch: StepBatch) -> None:
        """The step's samples table, read from the held messages now (the ack releases them) and
        written in the background: a table must never hold up or fail the step."""
        try:
            rows, parsed = [], {}
            for i, seq in enumerate(batch.sequences[: self.settings.samples_per_step]):
                d = self.held.get(seq.rollout_id)
                if d is None:
                    continue
                if d not in parsed:
                    parsed[d] = {r.rollout_id: r for r in rollout_messages.rollouts_in(d)}
                rollout = parsed[d].get(seq.rollout_id)
                if rollout is not None:
                    advantage = float(batch.advantages[i])
                    chars = self.settings.sample_chars
                    rows.append(sample_row(rollout, step, advantage, seq.length, seq.loss_tokens, chars))
        except Exception:
            log.exception("run %s: no samples table for step %d", self.run_id, step)
            return
        if rows:
            key = subjects.packer_samples_key(self.run_id, step)
            task = asyncio.create_task(self._put_quietly(key, json.dumps(rows).encode()))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _put_quietly(self, key: str, value: bytes) -> None:
        try:
            await self.store.kv.put(key, value)
        except Exception as exc:
            log.warning("run %s: a samples table was not saved: %s", self.run_id, exc)

    async def _wait_for(self, ready, deadline: float | None, step: int, selected: list | None = None) -> None:
        async with self._changed:
            while not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    have = (
                        f"; {len(selected)}/{self.settings.prompts_per_step} groups ready"
                        if selected is not None
                        else ""
                    )
                    raise DeadlineExceeded(f"timeout_seconds: step {step} not complete in time{have}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=min(remaining or 1.0, 1.0))

    async def ack_step(self, step: int, trainer_version: int) -> int:
        """The trainer finished `step`: record it, then ack its rollouts on the bus. Idempotent."""
        record = self.records.get(step)
        if record is None:
            raise FailedPrecondition(f"step: {step} was never planned (planned: {sorted(self.records)})")
        if record.acked:
            return 0
        record.acked = True
        record.acked_version = trainer_version
        record.acked_at = time.time()
        # Rollouts of this step we do not hold were delivered to a packer that died: the bus still
        # has them pending and redelivers them later; the record must outlive that.
        record.unsettled = [rid for rid in record.rollout_ids if rid not in self.held]
        await self.store.save(record)  # durable before any bus ack: a crash now cannot train it twice
        self._register(record)
        deliveries = []
        acked = 0
        for rid in record.rollout_ids:
            self.plan_of.pop(rid, None)
            self.plan_seqs.pop(rid, None)
            self.traceparents.pop(rid, None)
            d = self.held.pop(rid, None)
            if d is not None:
                acked += 1
                if self._release(d, rid):
                    deliveries.append(d)
        await Delivery.ack_all(deliveries)
        self.built.pop(step, None)
        self.acked_total += acked
        metrics.ACKED.labels(self.run_id).inc(acked)
        for old in await self.store.prune(self.records):
            # Beyond the kept window a rollout cannot be redelivered (it was acked), so its ids can go.
            forgotten = self.records.pop(old)
            for rid in forgotten.rollout_ids:
                self.trained.pop(rid, None)
            self.plan_groups.difference_update(forgotten.groups)
            self.collector.forget(forgotten.rollout_ids, list(forgotten.groups))
            every = self.settings.samples_every
            if every and old % every == 0:  # long copied by the gateway, which watches for it
                with contextlib.suppress(Exception):
                    await self.store.kv.delete(subjects.packer_samples_key(self.run_id, old))
        self._update_gauges()
        return acked

    # ---- stats ------------------------------------------------------------------------------------

    @property
    def has_unacked_steps(self) -> bool:
        """Steps served to the trainer that it has not acknowledged yet."""
        return any(not record.acked for record in self.records.values())

    @property
    def queued_rollouts(self) -> int:
        return sum(1 for rid in self.held if rid not in self.plan_of)

    @property
    def pending_groups(self) -> int:
        return self.collector.open_groups + len(self.ready)

    def _update_gauges(self) -> None:
        """Refresh the run's gauges, at most once a GAUGE_REFRESH_S (the intake loop comes by at
        least every fetch timeout, so a quiet run's gauges are current within a second)."""
        now = time.monotonic()
        if now < self._gauges_due:
            return
        self._gauges_due = now + GAUGE_REFRESH_S
        metrics.QUEUE_DEPTH.labels(self.run_id).set(self.queued_rollouts)
        metrics.PENDING_GROUPS.labels(self.run_id).set(self.pending_groups)
        metrics.UNACKED_STEPS.labels(self.run_id).set(sum(1 for r in self.records.values() if not r.acked))
