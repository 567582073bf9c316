"""The packer service in-process against a real nats-server: flow, bad rollouts, bad gRPC requests."""

from __future__ import annotations

import asyncio
import math
import urllib.request
import uuid

import grpc
import pytest
from prometheus_client import REGISTRY

from bench.harness.synthetic_rollouts import make_rollout
from looprl.common.v1 import common_pb2
from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.messages import rollouts as rollout_messages
from services.rollout_packer.step import PackerSettings
from tests.support.packer import running_packer


@pytest.fixture
async def packer(nats_url):
    async with running_packer(nats_url, ack_wait_s=2.0) as (app, service):
        app.metrics_port = service.metrics_port
        channel = grpc.aio.insecure_channel(service.address)
        try:
            yield app, packer_pb2_grpc.RolloutPackerServiceStub(channel)
        finally:
            await channel.close()


async def _publish(bus: Bus, run_id: str, rollouts) -> None:
    for r in rollouts:
        payload = r if isinstance(r, bytes) else r.SerializeToString()
        await bus.publish(subjects.rollouts(run_id), payload)


async def _publish_group(bus: Bus, run_id: str, rollouts) -> None:
    """The rollouts as RolloutGroup messages, as environment-sandbox publishes a task's group."""
    messages = rollout_messages.group_messages(rollouts, bus.nc.max_payload)
    await bus.publish_batch(subjects.rollouts(run_id), messages, rollout_messages.GROUP_HEADERS)


def _group(run_id: str, gid: str, size: int = 2, version: int = 0, **kw):
    return [
        make_rollout(
            f"{gid}-{i}",
            gid,
            run_id=run_id,
            group_size=size,
            sample_index=i,
            reward=float(i % 2),
            version=version,
            seed=i,
            completion_len=3 + i,
            **kw,
        )
        for i in range(size)
    ]


async def _fetch(stub, run_id, step, world=2, version=0, timeout=10.0):
    out = []
    for rank in range(world):
        req = packer_pb2.NextBatchRequest(
            run_id=run_id,
            step=step,
            rank=rank,
            world_size=world,
            trainer_version=version,
            timeout_seconds=timeout,
        )
        out.append([resp.micro_batch async for resp in stub.NextBatch(req)])
    return out


async def test_bad_rollouts_are_termed_with_reasons_and_the_stream_keeps_flowing(packer, nats_url) -> None:
    app, stub = packer
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    await app.add_run(
        run_id,
        PackerSettings(
            prompts_per_step=2, group_size=2, world_size=2, max_tokens_per_microbatch=64, max_staleness=1
        ),
    )
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        nan = make_rollout("bad-nan", "gx", run_id=run_id, reward=math.nan)
        mismatch = make_rollout("bad-lp", "gx", run_id=run_id)
        del mismatch.turns[1].logprobs[0]
        negative = make_rollout("bad-ver", "gx", run_id=run_id)
        negative.turns[1].weight_version = -1
        empty = make_rollout("bad-empty", "gx", run_id=run_id)
        del empty.turns[1:]
        too_long = make_rollout("bad-long", "gx", run_id=run_id, completion_len=100)
        stale = _group(run_id, "g-stale", version=0)
        await _publish(bus, run_id, [b"\xff\x00garbage", nan, mismatch, negative, empty, too_long, *stale])
        await _publish(bus, run_id, _group(run_id, "g1", version=3) + _group(run_id, "g2", version=3))
        await _publish(bus, run_id, _group(run_id, "g1", version=3)[:1])  # a duplicate

        batches = await _fetch(stub, run_id, step=0, version=3)
        ids = sorted(rid for rank in batches for mb in rank for rid in mb.rollout_ids)
        assert ids == ["g1-0", "g1-1", "g2-0", "g2-1"]
        assert len(batches[0]) == len(batches[1])  # equal micro-batch counts on every rank
        # the same step asked again (a trainer retry) is served identically
        again = await _fetch(stub, run_id, step=0, version=3)
        assert [[list(mb.rollout_ids) for mb in r] for r in again] == [
            [list(mb.rollout_ids) for mb in r] for r in batches
        ]

        ack = await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=0, trainer_version=4))
        assert ack.acked_rollouts == 4
        assert (await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=0))).acked_rollouts == 0

        stats = await stub.Stats(packer_pb2.StatsRequest(run_id=run_id))
        assert dict(stats.dropped) == {
            "malformed": 1,
            "non_finite_reward": 1,
            "logprob_length_mismatch": 1,
            "negative_version": 1,
            "empty_completion": 1,
            "too_long": 1,
            "stale": 2,
            "duplicate": 1,
        }
        assert stats.packed_steps == 1 and stats.acked_rollouts == 4 and stats.queued_rollouts == 0
        # The gauges are refreshed at most twice a second, and a quiet run's within a second.
        await asyncio.sleep(1.5)
        gauges = {
            name: REGISTRY.get_sample_value(f"looprl_packer_{name}", {"run": run_id})
            for name in ("queued_rollouts", "pending_groups", "unacked_steps")
        }
        assert gauges == {"queued_rollouts": 0, "pending_groups": 0, "unacked_steps": 0}
        # nothing is left for redelivery: terms and acks settled every message
        consumer = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
        assert consumer.num_ack_pending == 0 and consumer.num_pending == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{app.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert f'looprl_packer_dropped_rollouts_total{{reason="stale",run="{run_id}"}} 2.0' in text
        assert f'looprl_packer_padding_fraction{{run="{run_id}"}}' in text
    finally:
        await bus.close()


async def test_a_group_message_is_trained_as_its_rollouts_and_settled_once_none_needs_it(
    packer, nats_url
) -> None:
    app, stub = packer
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    await app.add_run(
        run_id, PackerSettings(prompts_per_step=2, group_size=2, world_size=1, max_tokens_per_microbatch=64)
    )
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        nan = make_rollout("bad-nan", "gx", run_id=run_id, reward=math.nan)
        await _publish_group(bus, run_id, [*_group(run_id, "g1"), nan])  # one message, one bad rollout
        await _publish_group(bus, run_id, _group(run_id, "g2"))
        headers = rollout_messages.GROUP_HEADERS
        await bus.publish(subjects.rollouts(run_id), common_pb2.RolloutGroup(), headers=headers)
        await _publish_group(bus, run_id, _group(run_id, "g1")[1:])  # g1-1 again, in another message

        batches = await _fetch(stub, run_id, step=0, world=1)
        assert sorted(rid for mb in batches[0] for rid in mb.rollout_ids) == ["g1-0", "g1-1", "g2-0", "g2-1"]
        consumer = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
        # The two messages holding trained-to-be rollouts wait for the step; the empty one was
        # termed, the duplicate acked, and the bad rollout did not settle its message early.
        assert consumer.num_ack_pending == 2 and consumer.num_redelivered == 0

        ack = await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=0, trainer_version=1))
        assert ack.acked_rollouts == 4
        consumer = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
        assert consumer.num_ack_pending == 0 and consumer.num_pending == 0
        stats = await stub.Stats(packer_pb2.StatsRequest(run_id=run_id))
        assert dict(stats.dropped) == {"non_finite_reward": 1, "malformed": 1, "duplicate": 1}
    finally:
        await bus.close()


async def test_held_rollouts_stay_with_the_packer_for_many_ack_waits(packer, nats_url) -> None:
    """Rollouts queued for a step no one asked for yet are kept alive, not redelivered elsewhere."""
    app, stub = packer
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    await app.add_run(
        run_id, PackerSettings(prompts_per_step=2, group_size=2, world_size=2, max_tokens_per_microbatch=64)
    )
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        await _publish(bus, run_id, _group(run_id, "g1") + _group(run_id, "g2"))
        await asyncio.sleep(3.5 * app.cfg.ack_wait_s)
        consumer = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
        assert consumer.num_ack_pending == 4 and consumer.num_redelivered == 0
        await _fetch(stub, run_id, step=0)
        ack = await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=0, trainer_version=1))
        assert ack.acked_rollouts == 4
    finally:
        await bus.close()


async def test_bad_requests_name_the_field(packer) -> None:
    app, stub = packer
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    await app.add_run(run_id, PackerSettings(prompts_per_step=1, group_size=2))

    async def code_of(req) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.NextBatch(req):
                pass
        return info.value.code(), info.value.details()

    code, msg = await code_of(packer_pb2.NextBatchRequest(run_id=run_id, step=-1, world_size=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("step")
    code, msg = await code_of(packer_pb2.NextBatchRequest(run_id=run_id, step=0, rank=2, world_size=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("rank")
    code, msg = await code_of(packer_pb2.NextBatchRequest(run_id=run_id, step=0, world_size=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("world_size")
    code, msg = await code_of(packer_pb2.NextBatchRequest(run_id="nope", step=0, world_size=1))
    assert code == grpc.StatusCode.NOT_FOUND and msg.startswith("run_id")
    code, msg = await code_of(
        packer_pb2.NextBatchRequest(run_id=run_id, step=0, world_size=1, timeout_seconds=0.3)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "0/1 groups" in msg
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=5))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "step" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(packer_pb2.StatsRequest(run_id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # still serving after all that
    stats = await stub.Stats(packer_pb2.StatsRequest(run_id=run_id))
    assert stats.packed_steps == 0


@pytest.mark.parametrize("publish", [_publish, _publish_group], ids=["bare", "grouped"])
async def test_crash_after_recording_the_ack_but_before_bus_acks_never_trains_twice(
    packer, nats_url, publish
) -> None:
    """The window between 'step acked' in KV and the bus acks: the redelivered rollouts are dropped,
    whether each came alone or with its group in one message."""
    app, stub = packer
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    settings = PackerSettings(prompts_per_step=2, group_size=2, world_size=1, max_tokens_per_microbatch=64)
    first = await app.add_run(run_id, settings)
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        for group in ("a", "b", "c"):
            await publish(bus, run_id, _group(run_id, group))
        batch = await _fetch(stub, run_id, step=0, world=1)
        trained = sorted(rid for mb in batch[0] for rid in mb.rollout_ids)
        # what AckStep does first (durable record), then the process dies before acking on the bus
        record = first.records[0]
        record.acked = True
        await first.store.save(record)
        await app.remove_run(run_id)  # hands every held rollout back: all of them are redelivered

        second = await app.add_run(run_id, settings)
        for _ in range(100):
            if second.dropped.get("already_trained", 0) == len(trained):
                break
            await asyncio.sleep(0.1)
        assert second.dropped["already_trained"] == len(trained)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _fetch(stub, run_id, step=0, world=1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # the untrained group goes on to the next step
        await _publish(bus, run_id, _group(run_id, "d"))
        nxt = await _fetch(stub, run_id, step=1, world=1)
        assert not set(trained) & {rid for mb in nxt[0] for rid in mb.rollout_ids}
    finally:
        await bus.close()


async def test_rollouts_of_a_dead_packer_redelivered_after_many_steps_are_not_trained_again(
    packer, nats_url
) -> None:
    """A packer killed while holding a planned step: its successor serves the step, the trainer acks
    it, and the run goes on for more steps than `keep_acked_steps` before the bus redelivers the dead
    packer's copies (one ack wait later). They are recognised as trained, not packed a second time."""
    app, stub = packer
    app.cfg.keep_acked_steps = 1
    run_id = f"svc-{uuid.uuid4().hex[:8]}"
    settings = PackerSettings(prompts_per_step=1, group_size=2, world_size=1, max_tokens_per_microbatch=64)
    first = await app.add_run(run_id, settings)
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        await _publish(bus, run_id, _group(run_id, "s0"))
        step0 = sorted(
            rid for mb in (await _fetch(stub, run_id, step=0, world=1))[0] for rid in mb.rollout_ids
        )
        # SIGKILL: nothing handed back, so the bus redelivers step 0's rollouts only after ack_wait
        app.runs.pop(run_id)
        await first.stop(hand_back=False)

        second = await app.add_run(run_id, settings)
        await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=0, trainer_version=1))
        for step in range(1, 4):  # more acked steps than keep_acked_steps
            await _publish(bus, run_id, _group(run_id, f"s{step}", version=step))
            await _fetch(stub, run_id, step=step, world=1, version=step)
            await stub.AckStep(packer_pb2.AckStepRequest(run_id=run_id, step=step, trainer_version=step + 1))
        for _ in range(100):
            if second.dropped.get("already_trained", 0) == len(step0):
                break
            await asyncio.sleep(0.1)
        assert second.dropped.get("already_trained", 0) == len(step0), dict(second.dropped)
        await _publish(bus, run_id, _group(run_id, "s4", version=4))
        nxt = await _fetch(stub, run_id, step=4, world=1, version=4)
        assert not set(step0) & {rid for mb in nxt[0] for rid in mb.rollout_ids}
        assert not second.records[0].unsettled  # every copy the bus held is acked now
    finally:
        await bus.close()


async def test_step_records_survive_in_kv_and_old_acked_ones_are_pruned(nats_url) -> None:
    from services.rollout_packer.state import StepRecord, StepStore

    bus = await Bus.connect(nats_url, name="test-store")
    try:
        await bus.ensure_streams(buckets=(*subjects.BUCKETS, subjects.BucketSpec("packer")))
        run_id = f"st-{uuid.uuid4().hex[:8]}"
        store = StepStore(await bus.kv("packer"), run_id, keep_acked=1)
        for step in range(3):
            await store.save(StepRecord(step, step, 2, {"g": [f"r{step}a", f"r{step}b"]}, acked=step < 2))
        other = StepStore(await bus.kv("packer"), f"{run_id}x", keep_acked=1)
        await other.save(StepRecord(0, 0, 1, {"h": ["x"]}))
        records = await store.load()
        assert sorted(records) == [0, 1, 2] and records[2].rollout_ids == ["r2a", "r2b"]
        assert await store.prune(records) == [0]
        reloaded = await StepStore(await bus.kv("packer"), run_id).load()
        assert sorted(reloaded) == [1, 2] and reloaded[1].acked and not reloaded[2].acked

        # beyond the window but acked within settle_s, or with rollouts still pending on the bus: kept
        store = StepStore(await bus.kv("packer"), run_id, keep_acked=0, settle_s=60)
        recent = StepRecord(3, 3, 1, {"g": ["r3"]}, acked=True, acked_at=1000.0)
        pending = StepRecord(4, 4, 1, {"g": ["r4"]}, acked=True, acked_at=1000.0, unsettled=["r4"])
        for record in (recent, pending):
            await store.save(record)
        records = {3: recent, 4: pending}
        assert await store.prune(records, now=1030.0) == []
        assert await store.prune(records, now=1100.0) == [3]
        assert await store.prune({4: pending}, now=1599.0) == []
        assert await store.prune({4: pending}, now=1601.0) == [4]
    finally:
        await bus.close()
