"""A real sequence-classification reward model on real Ray actor replicas: batching, scores that
depend on the text, scaling up under a burst and back down when idle."""

from __future__ import annotations

import asyncio

import pytest

from services.reward.registry import default_registry
from services.reward.reward_model import ModelPoolConfig, RewardModelPool
from services.reward.verifiers import ScoreInput

pytestmark = pytest.mark.slow


async def test_reward_model_replicas_batch_and_autoscale(ray_client):
    config = ModelPoolConfig(
        min_replicas=1,
        max_replicas=2,
        max_batch=8,
        max_wait_s=0.02,
        target_queue_per_replica=4,
        scale_interval_s=0.05,
        scale_down_after_s=0.3,
    )
    pool = await RewardModelPool(config).start()
    try:
        texts = [f"answer {i % 5}" for i in range(64)]
        scores = await asyncio.gather(*(pool.score(t) for t in texts))
        assert all(0.0 <= s <= 1.0 for s in scores)
        # Same text, same score (whatever replica or batch it landed in); different texts differ.
        by_text: dict[str, set] = {}
        for t, s in zip(texts, scores, strict=True):
            by_text.setdefault(t, set()).add(round(s, 5))
        assert all(len(v) == 1 for v in by_text.values())
        assert len({next(iter(v)) for v in by_text.values()}) > 1
        assert pool.batches_sent < len(texts)  # requests were batched
        assert pool.peak_replicas == 2
        for _ in range(100):
            if pool.replicas == 1:
                break
            await asyncio.sleep(0.05)
        assert pool.replicas == 1

        reg = default_registry()
        reg.add_verifier("rm", pool.verifier(), "tiny reward model", kind="model")
        reg.add_composite("digits_rm", [("digits_partial", 0.8), ("rm", 0.2)])
        out = await reg.score("digits_rm", ScoreInput({"digits": "12"}, "21", transcript="rev 12 -> 21"))
        assert out.ok and 0.8 <= out.score <= 1.0
    finally:
        await pool.close()


async def test_a_crashed_reward_model_replica_is_restarted_and_its_batch_scored(ray_client):
    import ray

    config = ModelPoolConfig(min_replicas=1, max_replicas=1, max_batch=4, max_wait_s=0.01)
    pool = await RewardModelPool(config).start()
    try:
        before = await pool.score("answer 1")
        ray.kill(pool.pool.members[0].handle, no_restart=False)  # as a crash: Ray may restart it
        after = await asyncio.gather(*(pool.score("answer 1") for _ in range(4)))
        assert after == [before] * 4
        assert pool.replicas == 1
    finally:
        await pool.close()
