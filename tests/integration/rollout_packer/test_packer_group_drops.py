"""The packer's reports to the run's driver, against a real nats-server: a group dropped whole is in
KV before its rollouts are acked, once however often it comes back (a restarted packer loads the
drops and drops a redelivered group again under the same record), and the samples table of a step
holds its first rollouts as text, reward, advantage, lengths and version."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

from bench.harness.synthetic_rollouts import make_rollout
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.messages import rollouts as rollout_messages
from services.kit.messages.packer_reports import parse_drops
from services.rollout_packer.step import PackerSettings
from tests.support.packer import running_packer

SETTINGS = PackerSettings(prompts_per_step=2, group_size=2, world_size=1, samples_every=1, samples_per_step=3)


def _group(run_id: str, name: str, rewards: tuple[float, float]):
    # Ids of this run's own: message ids hash the rollout ids, and the stream dedups them.
    gid = f"{run_id}-{name}"
    rollouts = []
    for i, reward in enumerate(rewards):
        r = make_rollout(
            f"{gid}-{i}", gid, run_id=run_id, group_size=2, sample_index=i, reward=reward, seed=i
        )
        r.turns[0].text, r.turns[1].text = f"prompt of {gid}", f"answer {i}"
        rollouts.append(r)
    return rollouts


async def _publish(bus: Bus, run_id: str, rollouts, again: bool = False) -> None:
    """As environment-sandbox publishes a group; `again`: a redelivery the stream's dedup window
    would not stop (the bus's own redelivery of an unacked message looks the same to the packer)."""
    messages = rollout_messages.group_messages(rollouts, bus.nc.max_payload)
    if again:
        messages = [(payload, f"{msg_id}-again") for payload, msg_id in messages]
    await bus.publish_batch(subjects.rollouts(run_id), messages, rollout_messages.GROUP_HEADERS)


async def _until(predicate, timeout: float = 10.0):
    for _ in range(int(timeout / 0.05)):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("not in time")


async def test_a_dropped_group_is_recorded_once_and_a_step_samples_table_is_written(nats_url) -> None:
    run_id = f"drops-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="test-sandbox")
    kv = None

    async def drops():
        raw = await kv.get(subjects.packer_drops_key(run_id, 0))
        return parse_drops(raw) if raw else None

    try:
        async with running_packer(nats_url) as (app, _):
            kv = await bus.kv(subjects.PACKER_STEPS)  # the packer made it
            settings = dataclasses.replace(SETTINGS, filter_zero_variance=True)
            packer = await app.add_run(run_id, settings)
            await _publish(bus, run_id, _group(run_id, "g0", (0.0, 0.0)))
            (drop,) = await _until(drops)
            assert (drop.group_id, drop.reason) == (f"{run_id}-g0", "zero_variance_group")

            # A packer started afresh (its predecessor's acks lost) meets the group again.
            await app.remove_run(run_id)
            packer = await app.add_run(run_id, settings)
            await _publish(bus, run_id, _group(run_id, "g0", (0.0, 0.0)), again=True)
            await _until(lambda: _dropped(packer, "zero_variance_group", 2))
            assert [d.group_id for d in await drops()] == [f"{run_id}-g0"]  # the same drop, not a second

            # The step fills from the groups with signal (the gateway's replacements).
            await _publish(bus, run_id, _group(run_id, "g1", (0.0, 1.0)))
            await _publish(bus, run_id, _group(run_id, "g2", (1.0, 0.5)))
            batch = await packer.step_batch(0, 1, 0, timeout_s=10)
            assert sorted({s.group_id for s in batch.sequences}) == [f"{run_id}-g1", f"{run_id}-g2"]

            raw = await _until(lambda: kv.get(subjects.packer_samples_key(run_id, 0)))
            rows = json.loads(raw)
            assert [r["rollout_id"] for r in rows] == [s.rollout_id for s in batch.sequences[:3]]
            for row, seq, advantage in zip(rows, batch.sequences, batch.advantages, strict=False):
                assert row["prompt"] == f"prompt of {seq.group_id}" and row["completion"].startswith(
                    "answer "
                )
                assert row["reward"] == seq.reward and row["advantage"] == float(advantage)
                assert (row["tokens"], row["response_tokens"]) == (seq.length, seq.loss_tokens)
                assert row["weight_version"] == seq.min_version and row["step"] == 0
    finally:
        await bus.close()


async def _dropped(packer, reason: str, count: int) -> bool:
    return packer.dropped[reason] >= count
