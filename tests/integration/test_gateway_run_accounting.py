"""A run's accounting goes out in batches (gateway/run_accounting.py): step records that arrive
together cost one write of the record every service watches, not one each, and the bus deliveries
they came from are acked only once written, so a write that fails leaves them queued and unacked.
Against a real nats-server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.run_accounting import RunAccounting
from gateway.run_store import RunStore
from gateway.runs import _apply_step, history_entry
from looprl.events.v1 import events_pb2
from services.kit import subjects
from services.kit.bus import Bus, Delivery
from services.kit.kv import KV
from services.kit.recipe import RunRecord

STEPS = 10


async def _record_writes(kv: KV, run_id: str, seen: list[int]) -> None:
    async with kv.watch(run_id) as watch:
        async for entry in watch:
            seen.append(entry.revision)


async def _step_deliveries(bus: Bus, run_id: str) -> list[Delivery]:
    for n in range(STEPS):
        record = events_pb2.TrainStepRecord(run_id=run_id, step=n, version=n + 1, num_rollouts=4)
        await bus.publish(subjects.train(run_id), record, msg_id=f"{run_id}-train-{n}")
    consumer = await bus.pull_consumer(subjects.TRAIN, f"acct-{run_id}", subjects.train(run_id), ack_wait=30)
    deliveries: list[Delivery] = []
    while len(deliveries) < STEPS:
        deliveries += await consumer.fetch(batch=STEPS, timeout=2.0)
    return deliveries


def _account(accounting: RunAccounting, deliveries: list[Delivery]) -> None:
    for delivery in deliveries:
        step = delivery.parse(events_pb2.TrainStepRecord)
        accounting.add(
            lambda r, s=step: _apply_step(r, s, None), history=history_entry(step), ack=("train", delivery)
        )


async def _unacked(bus: Bus, run_id: str) -> int:
    info = await bus.js.consumer_info(subjects.TRAIN, f"acct-{run_id}")
    return info.num_ack_pending


async def test_steps_arriving_together_are_one_record_write_acked_after_it(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, name="accounting-test")
    try:
        await bus.ensure_streams()
        kv = await bus.kv(subjects.RUNS)
        store = RunStore(kv)
        run_id = f"acct-{uuid.uuid4().hex[:6]}"
        await store.create(RunRecord(run_id=run_id, recipe_toml="", state="running"))
        writes: list[int] = []
        watcher = asyncio.create_task(_record_writes(kv, run_id, writes))
        deliveries = await _step_deliveries(bus, run_id)

        accounting = RunAccounting(store, run_id, flush_s=60.0)
        _account(accounting, deliveries)
        assert await _unacked(bus, run_id) == STEPS  # nothing acked before it is written
        await accounting.flush()
        await asyncio.sleep(0.3)  # the watch delivers the write
        watcher.cancel()

        record = await store.get(run_id)
        assert record.step == STEPS and record.extra["rollouts_trained"] == 4 * STEPS
        assert [h["step"] for h in await store.history(record)] == list(range(STEPS))
        assert len(writes) == 2  # the created record, then one write for all ten steps
        assert await _unacked(bus, run_id) == 0
    finally:
        await bus.close()


async def test_a_failed_write_keeps_the_steps_queued_and_unacked(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, name="accounting-test")
    try:
        await bus.ensure_streams()
        kv = await bus.kv(subjects.RUNS)
        store = RunStore(kv)
        run_id = f"acct-{uuid.uuid4().hex[:6]}"
        deliveries = await _step_deliveries(bus, run_id)
        accounting = RunAccounting(store, run_id, flush_s=60.0)
        _account(accounting, deliveries)

        # No record to update yet: the flush fails and nothing is acked or lost.
        with pytest.raises(KeyError):
            await accounting.flush()
        assert await _unacked(bus, run_id) == STEPS

        await store.create(RunRecord(run_id=run_id, recipe_toml="", state="running"))
        await accounting.flush()
        record = await store.get(run_id)
        assert record.step == STEPS and record.extra["counted_steps"] == [[0, STEPS - 1]]
        assert await _unacked(bus, run_id) == 0
    finally:
        await bus.close()
