"""Shared rate limits: N workers in separate Ray processes together never exceed the limit."""

from __future__ import annotations

import time

import pytest

from services.environment_sandbox.ratelimit import Limit, RateLimiter, TokenBuckets, rate_limiter_actor


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
                assert j - i + 1 <= 2 + 20.0 * window + 1, (i, j, window)
        assert stamps[-1] - stamps[0] >= (40 - 2) / 20.0 - 0.1
    finally:
        ray.kill(actor)


def test_client_wraps_the_actor_interface():
    assert RateLimiter(object()).actor is not None
