"""Shared rate limits: N workers in separate Ray processes together never exceed the limit."""

from __future__ import annotations

import time

import pytest

from services.environment_sandbox.ratelimit import Limit, RateLimiter, TokenBuckets, rate_limiter_actor

# Grants are exact; the stamps are taken after an asyncio.sleep in a busy process, which can wake
# late and bunch up with the next use: allow that much scheduling slack per window.
JITTER_S = 0.05


def test_bucket_never_grants_more_than_rate_plus_burst():
    now = [0.0]
    buckets = TokenBuckets(
        {"api": Limit(requests_per_s=10, request_burst=2, tokens_per_s=100)}, clock=lambda: now[0]
    )
    waits = [buckets.reserve("api") for _ in range(5)]
    assert waits == pytest.approx([0, 0, 0.1, 0.2, 0.3])
    now[0] = 10.0
    assert buckets.reserve("api", tokens=250) == pytest.approx(1.5)  # tokens/s is the tighter limit
    assert buckets.reserve("unknown") == 0.0


@pytest.mark.slow
def test_workers_in_separate_processes_share_one_limit(ray_client):
    import ray

    actor = rate_limiter_actor(name=f"rl-test-{time.time_ns()}")
    ray.get(actor.configure.remote("api", {"requests_per_s": 20.0, "request_burst": 2.0}))

    @ray.remote(num_cpus=0)
    def worker(handle, count: int) -> list[float]:
        import asyncio

        from services.environment_sandbox.ratelimit import RateLimiter

        async def go() -> list[float]:
            limiter = RateLimiter(handle)
            stamps = []
            for _ in range(count):
                await limiter.acquire("api")
                stamps.append(time.time())
            return stamps

        return asyncio.run(go())

    try:
        stamps = sorted(s for batch in ray.get([worker.remote(actor, 10) for _ in range(4)]) for s in batch)
        assert len(stamps) == 40
        # In every window, uses <= burst + rate * window (small slack for clock reads across processes).
        for i, start in enumerate(stamps):
            for j in range(i, len(stamps)):
                window = stamps[j] - start
                assert j - i + 1 <= 2 + 20.0 * (window + JITTER_S) + 1, (i, j, window)
        assert stamps[-1] - stamps[0] >= (40 - 2) / 20.0 - 0.1
    finally:
        ray.kill(actor)


@pytest.mark.slow
async def test_a_restarted_limiter_actor_enforces_the_limits_it_had(ray_client):
    import ray

    actor = rate_limiter_actor(name=f"rl-restart-{time.time_ns()}")
    limiter = RateLimiter(actor)
    await limiter.configure("api", Limit(requests_per_s=2.0, request_burst=1.0))
    try:
        assert await limiter.acquire("api") == 0.0
        ray.kill(actor, no_restart=False)  # as a crash: Ray restarts it with no buckets
        while ray.get(actor.reserve.remote("api", 0.0, 0.0)) is not None:  # until it has restarted
            time.sleep(0.05)
        await limiter.acquire("api")
        # The restarted actor knows the limit again: the next use waits for the bucket.
        assert await limiter.acquire("api") >= 0.4
    finally:
        ray.kill(actor)


def test_client_wraps_the_actor_interface():
    assert RateLimiter(object()).actor is not None


@pytest.mark.slow
def test_agent_loops_in_separate_processes_share_the_inference_limit(ray_client):
    """The agent-loop path: episode runners in 4 Ray worker processes, each configuring the limit
    from the environment config it was given (as every service process does on its own), reserve
    'inference' before each model turn against the one actor; together they stay under it."""
    import ray

    actor = rate_limiter_actor(name=f"rl-loop-test-{time.time_ns()}")
    config = {"max_turns": 3, "rate_limits": {"inference": {"requests_per_s": 30, "request_burst": 2}}}

    @ray.remote(num_cpus=0)
    def episode_worker(handle, worker: int, env_config: dict) -> list[float]:
        import asyncio
        import json

        from looprl.common.v1 import common_pb2
        from looprl.events.v1 import events_pb2
        from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime
        from services.environment_sandbox.ratelimit import RateLimiter
        from services.modeling.tokenizer import CharTokenizer

        tok = CharTokenizer()
        stamps: list[float] = []

        async def policy(prompt_ids, sampling, session_id, min_weight_version):
            stamps.append(time.time())
            ids = [*tok.encode("1"), tok.eos_token_id]  # a wrong guess: every episode plays 3 turns
            return ModelTurn(ids, [-0.1] * len(ids), "stop", 0)

        async def go() -> None:
            runner = EpisodeRunner(OneAtATime(policy), None, tok, limiter=RateLimiter(handle))
            tasks = [
                events_pb2.EpisodeTask(
                    run_id="r",
                    task_id=f"w{worker}-{i}",
                    group_id="g",
                    environment="guess",
                    task_json=json.dumps({"secret": 7, "high": 8}),
                    sampling=common_pb2.SamplingParams(max_tokens=3),
                    environment_config_json=json.dumps(env_config),
                )
                for i in range(3)
            ]
            rollouts = await asyncio.gather(*(runner.run(t) for t in tasks))
            assert all(len(r.turns) == 6 for r in rollouts)

        asyncio.run(go())
        return stamps

    try:
        batches = ray.get([episode_worker.remote(actor, w, config) for w in range(4)], timeout=60)
        stamps = sorted(s for batch in batches for s in batch)
        assert len(stamps) == 4 * 3 * 3 and all(len(b) == 9 for b in batches)
        for i, start in enumerate(stamps):
            for j in range(i, len(stamps)):
                window = stamps[j] - start
                assert j - i + 1 <= 2 + 30.0 * (window + JITTER_S) + 1, (i, j, window)
        assert stamps[-1] - stamps[0] >= (36 - 2) / 30.0 - 0.1
    finally:
        ray.kill(actor)
