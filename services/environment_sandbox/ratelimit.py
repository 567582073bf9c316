"""Shared rate limits: one token bucket per named resource (requests/s and tokens/s), its state
in a single Ray actor that every episode worker in every process asks before using the resource.

Callers reserve instead of polling: `reserve` takes the tokens now (the bucket may go negative)
and answers how long the caller must wait before using them. Reservations are granted in arrival
order and their waits add up, so however many workers ask at once, the resource is never used
faster than its rate plus its burst; nobody spins re-asking the actor.

Without Ray the same buckets live in the process (`RateLimiter.local()`): correct for one
process, and what a laptop or a test without a Ray head gets. Limits come from the service config
(`LOOPRL_ENV_RATE_LIMITS`, the operator's quota for resources every run shares) and from an
environment's config (`rate_limits` in the recipe's environment config); `parse_limits` validates
both and names the bad field.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any


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
        """Set a resource's limit. Idempotent: every process (re)configures the resources it
        uses on start-up, and a repeated configure must not refill a bucket others drained; a
        changed limit keeps the current levels (clamped to the new bursts)."""
        now = self.clock()
        if self.limits.get(name) == limit:
            return
        self.limits[name] = limit
        token_burst = limit.token_burst or limit.tokens_per_s
        fresh = (
            _Bucket(limit.requests_per_s, limit.request_burst, now),
            _Bucket(limit.tokens_per_s, token_burst, now),
        )
        old = self._buckets.get(name)
        if old is not None:
            for new_bucket, old_bucket in zip(fresh, old, strict=True):
                if old_bucket.rate > 0:
                    elapsed = now - old_bucket.stamp
                    level = min(old_bucket.burst, old_bucket.level + elapsed * old_bucket.rate)
                    new_bucket.level = min(new_bucket.burst, level)
        self._buckets[name] = fresh

    def reserve(self, name: str, requests: float = 1.0, tokens: float = 0.0) -> float:
        """Seconds the caller must wait before using the resource; unknown names are unlimited."""
        buckets = self._buckets.get(name)
        if buckets is None:
            return 0.0
        now = self.clock()
        return max(buckets[0].reserve(requests, now), buckets[1].reserve(tokens, now))


class LimitError(ValueError):
    """A rate-limit definition is malformed; the message names the field."""


def parse_limits(raw: Any, where: str) -> dict[str, Limit]:
    """{"resource": {"requests_per_s": 50, "tokens_per_s": 5000, ...}} (dict or JSON text) ->
    Limits; `where` prefixes error messages (for example "environment_config.rate_limits")."""
    if raw in (None, "", {}):
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LimitError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LimitError(f"{where}: must be an object of resource name -> limit")
    known = {f.name for f in fields(Limit)}
    out: dict[str, Limit] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name:
            raise LimitError(f"{where}: resource names must be non-empty strings")
        if not isinstance(spec, dict):
            raise LimitError(f"{where}.{name}: must be an object like {{'requests_per_s': 10}}")
        for key, value in spec.items():
            if key not in known:
                raise LimitError(f"{where}.{name}.{key}: unknown setting; known: {', '.join(sorted(known))}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise LimitError(f"{where}.{name}.{key}: expected a number, got {value!r}")
            if value < 0:
                raise LimitError(f"{where}.{name}.{key}: must be >= 0, got {value}")
        limit = Limit(**{k: float(v) for k, v in spec.items()})
        if limit.requests_per_s > 0 and limit.request_burst <= 0:
            raise LimitError(f"{where}.{name}.request_burst: must be > 0 when requests_per_s is set")
        out[name] = limit
    return out


def rate_limiter_actor(name: str = "looprl-rate-limits", namespace: str | None = None):
    """The one named Ray actor holding the buckets (created on first use, then shared)."""
    import ray

    # Restarted by Ray when it crashes; it then holds no limits, so `reserve` says which resource
    # it does not know and the client configures it again (limits never lapse with the actor).
    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
    class RateLimiterActor:
        def __init__(self) -> None:
            self.state = TokenBuckets()

        def configure(self, resource: str, limit: dict) -> None:
            self.state.configure(resource, Limit(**limit))

        def reserve(self, resource: str, requests: float = 1.0, tokens: float = 0.0) -> float | None:
            if resource not in self.state.limits:
                return None
            return self.state.reserve(resource, requests, tokens)

    return RateLimiterActor.options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached"
    ).remote()


class RateLimiter:
    """Client side: `await limiter.acquire("openai", tokens=512)` before each use.

    Backed by the shared Ray actor (`RateLimiter(actor)`) or by buckets in this process
    (`RateLimiter.local()`); callers cannot tell the difference except in who else is counted.
    """

    def __init__(
        self,
        actor: Any = None,
        local: TokenBuckets | None = None,
        connect: Callable[[], Any] | None = None,
    ) -> None:
        self.actor = actor
        self._local = local
        # Joins Ray and returns the actor on first use: a service whose runs name no limits
        # never pays for a Ray connection (the one-time ray.init blocks the loop ~1 s).
        self._connect = connect
        self._configured: dict[str, Limit] = {}
        self.waited_s = 0.0  # total time callers were held back (a metric, and a test aid)

    @classmethod
    def local(cls) -> RateLimiter:
        return cls(local=TokenBuckets())

    @classmethod
    def lazy(cls, connect: Callable[[], Any]) -> RateLimiter:
        return cls(connect=connect)

    @property
    def shared(self) -> bool:
        return self._local is None

    def _backend(self) -> Any:
        if self.actor is None and self._local is None:
            if self._connect is None:
                self._local = TokenBuckets()
            else:
                self.actor = self._connect()
        return self.actor

    async def configure(self, resource: str, limit: Limit) -> None:
        self._backend()
        if self._local is not None:
            self._local.configure(resource, limit)
        else:
            await self.actor.configure.remote(resource, asdict(limit))
        self._configured[resource] = limit

    async def ensure(self, limits: dict[str, Limit]) -> None:
        """Configure the resources this process has not configured with these values yet
        (one actor call per new or changed resource, not one per episode)."""
        for name, limit in limits.items():
            if self._configured.get(name) != limit:
                await self.configure(name, limit)

    async def acquire(self, resource: str, requests: float = 1.0, tokens: float = 0.0) -> float:
        self._backend()
        if self._local is not None:
            wait = self._local.reserve(resource, requests, tokens)
        else:
            wait = await self.actor.reserve.remote(resource, requests, tokens)
            if wait is None and resource in self._configured:  # a restarted actor
                await self.configure(resource, self._configured[resource])
                wait = await self.actor.reserve.remote(resource, requests, tokens)
            wait = wait or 0.0
        if wait > 0:
            self.waited_s += wait
            await asyncio.sleep(wait)
        return wait
