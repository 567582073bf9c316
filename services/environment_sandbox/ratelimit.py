"""Shared rate limits: one token bucket per named resource (requests/s and tokens/s), its state
in a single Ray actor that every episode worker in every process asks before using the resource.

Callers reserve instead of polling: `reserve` takes the tokens now (the bucket may go negative)
and answers how long the caller must wait before using them. Reservations are granted in arrival
order and their waits add up, so however many workers ask at once, the resource is never used
faster than its rate plus its burst; nobody spins re-asking the actor.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class Limit:
    requests_per_s: float = 0.0  # 0: unlimited
    request_burst: float = 1.0
    tokens_per_s: float = 0.0
    token_burst: float = 0.0


class _Bucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, max(burst, 1e-9)
        self.level, self.stamp = self.burst, now

    def reserve(self, amount: float, now: float) -> float:
        if self.rate <= 0 or amount <= 0:
            return 0.0
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        self.level -= amount
        return 0.0 if self.level >= 0 else -self.level / self.rate


class TokenBuckets:
    """The bucket state (plain class: the actor wraps it, and tests use it directly)."""

    def __init__(self, limits: dict[str, Limit] | None = None, clock=time.monotonic) -> None:
        self.clock = clock
        self.limits: dict[str, Limit] = {}
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {}
        for name, limit in (limits or {}).items():
            self.configure(name, limit)

    def configure(self, name: str, limit: Limit) -> None:
        now = self.clock()
        self.limits[name] = limit
        token_burst = limit.token_burst or limit.tokens_per_s
        self._buckets[name] = (
            _Bucket(limit.requests_per_s, limit.request_burst, now),
            _Bucket(limit.tokens_per_s, token_burst, now),
        )

    def reserve(self, name: str, requests: float = 1.0, tokens: float = 0.0) -> float:
        """Seconds the caller must wait before using the resource; unknown names are unlimited."""
        buckets = self._buckets.get(name)
        if buckets is None:
            return 0.0
        now = self.clock()
        return max(buckets[0].reserve(requests, now), buckets[1].reserve(tokens, now))


def rate_limiter_actor(name: str = "looprl-rate-limits", namespace: str | None = None):
    """The one named Ray actor holding the buckets (created on first use, then shared)."""
    import ray

    @ray.remote(num_cpus=0)
    class RateLimiterActor:
        def __init__(self) -> None:
            self.state = TokenBuckets()

        def configure(self, resource: str, limit: dict) -> None:
            self.state.configure(resource, Limit(**limit))

        def reserve(self, resource: str, requests: float = 1.0, tokens: float = 0.0) -> float:
            return self.state.reserve(resource, requests, tokens)

    return RateLimiterActor.options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached"
    ).remote()


class RateLimiter:
    """Client side: `await limiter.acquire("openai", tokens=512)` before each use."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def configure(self, resource: str, limit: Limit) -> None:
        await self.actor.configure.remote(resource, limit.__dict__)

    async def acquire(self, resource: str, requests: float = 1.0, tokens: float = 0.0) -> float:
        wait = await self.actor.reserve.remote(resource, requests, tokens)
        if wait > 0:
            await asyncio.sleep(wait)
        return wait
