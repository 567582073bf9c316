"""A run's per-step history is kept beside its record in the "runs" bucket, in chunks: a step adds to
one chunk, a redelivered step is neither added nor counted twice (even out of order), the record
every service watches stays the same size whatever the step, and services watching run records
(`*`) never see the chunks. Against a real nats-server."""

from __future__ import annotations

import asyncio
import uuid

from gateway.run_store import HISTORY_CHUNK, RunStore
from gateway.runs import _apply_step, history_entry
from looprl.events.v1 import events_pb2
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord


def _step(n: int) -> events_pb2.TrainStepRecord:
    return events_pb2.TrainStepRecord(step=n, version=n + 1, num_rollouts=4, reward_mean=n / 10)


async def _train(store: RunStore, run_id: str, n: int) -> None:
    await store.add_history(run_id, history_entry(_step(n)))
    await store.update(run_id, lambda r: _apply_step(r, _step(n), None))


async def test_history_is_chunked_beside_a_record_that_stays_small(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, name="history-test")
    try:
        await bus.ensure_streams()
        kv = await bus.kv("runs")
        store = RunStore(kv)
        run_id = f"hist-run-{uuid.uuid4().hex[:6]}"
        await store.create(RunRecord(run_id=run_id, recipe_toml="", state="running"))
        seen: list[str] = []

        async def watch_records() -> None:
            async with kv.watch("*") as watch:
                async for entry in watch:
                    seen.append(entry.key)

        watcher = asyncio.create_task(watch_records())
        for n in range(HISTORY_CHUNK - 2):
            await _train(store, run_id, n)
        small = len((await store.get(run_id)).to_json())
        for n in range(HISTORY_CHUNK - 2, HISTORY_CHUNK + 5):
            await _train(store, run_id, n)
        # Redeliveries, one of them out of order, change nothing.
        for n in (3, HISTORY_CHUNK + 1, 0):
            await _train(store, run_id, n)

        record = await store.get(run_id)
        history = await store.history(record)
        assert [h["step"] for h in history] == list(range(HISTORY_CHUNK + 5))
        assert record.extra["rollouts_trained"] == 4 * (HISTORY_CHUNK + 5)
        assert record.step == HISTORY_CHUNK + 5 and record.weight_version == HISTORY_CHUNK + 5
        assert record.extra["counted_steps"] == [[0, HISTORY_CHUNK + 4]]
        assert len(record.to_json()) <= small + 8  # a few digits more, not a line per step
        # The bucket is shared with other tests' runs: look at this run's keys only.
        mine = sorted({**await kv.items(run_id), **await kv.items(f"{run_id}.>")})
        assert mine == [run_id, f"{run_id}.history.0", f"{run_id}.history.1"]
        listed = [r.run_id for r in await store.list()]
        assert run_id in listed and not any("." in r for r in listed)
        await asyncio.sleep(0.3)
        watcher.cancel()
        assert run_id in seen and not any(".history." in k for k in seen)
    finally:
        await bus.drain()


def test_a_step_missed_in_between_is_still_counted_when_it_arrives() -> None:
    record = RunRecord(run_id="r", recipe_toml="")
    for n in (0, 1, 3, 2, 3, 4):
        _apply_step(record, _step(n), None)
    assert record.extra["counted_steps"] == [[0, 4]]
    assert record.extra["rollouts_trained"] == 4 * 5


class _CountingKV:
    """The real bucket, counting the reads made through it."""

    def __init__(self, kv) -> None:
        self.kv, self.reads = kv, 0

    def __getattr__(self, name: str):
        return getattr(self.kv, name)

    async def get(self, key: str):
        self.reads += 1
        return await self.kv.get(key)

    async def entry(self, key: str):
        self.reads += 1
        return await self.kv.entry(key)


async def test_a_driver_step_reads_nothing_back_yet_loses_no_other_writers_change(nats_url: str) -> None:
    """The driver's own writes are remembered (record revision, current history chunk), so a step
    writes without reading and showing the run reads no chunk back; a change another writer made in
    between still survives the next update."""
    bus = await Bus.connect(nats_url, name="history-cache-test")
    try:
        await bus.ensure_streams()
        kv = await bus.kv("runs")
        counting = _CountingKV(kv)
        driver, other = RunStore(counting), RunStore(kv)
        run_id = f"cache-run-{uuid.uuid4().hex[:6]}"
        await driver.create(RunRecord(run_id=run_id, recipe_toml="", state="running"))
        await _train(driver, run_id, 0)  # reads the record and the chunk once
        reads = counting.reads
        for n in range(1, 6):
            await _train(driver, run_id, n)
        assert counting.reads == reads
        # Nor does showing the run (every WatchRun poll) read back the chunk the driver writes.
        record = await driver.get(run_id)
        assert [h["step"] for h in await driver.history(record)] == list(range(6))
        assert counting.reads == reads + 1  # the record itself

        await other.update(run_id, lambda r: r.extra.__setitem__("stalled_reason", "set elsewhere"))
        await _train(driver, run_id, 6)
        record = await other.get(run_id)
        assert record.extra["stalled_reason"] == "set elsewhere" and record.step == 7
        assert [h["step"] for h in await other.history(record)] == list(range(7))
    finally:
        await bus.drain()
