"""A pool of Ray actors scaled between min and max by queue depth: the reward service's model
replicas and the environment-sandbox's sandbox workers are both one.

The pool keeps each actor's handle with its work in flight, hands out the least loaded one, and
every `interval_s` asks the Autoscaler (services/kit/ray/autoscale.py) how many there should be for the
owner's queue depth: it starts the missing ones at once and retires an idle one at a time (a busy
one finishes first). How an actor is made and retired, and what the queue depth is, are the
owner's; the pool itself is plain Python over handles, tested without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.kit.ray.autoscale import Autoscaler

H = TypeVar("H")


@dataclass(eq=False)
class Member(Generic[H]):
    """One actor of the pool: its handle, the work it has in flight, and whether it has started
    (for owners that route only to actors Ray has placed; they set it)."""

    handle: H
    in_flight: int = 0
    started: bool = False


class AutoscaledPool(Generic[H]):
    """Actors made by `make`, retired by `retire`, scaled by `autoscaler` on `queue_depth()`.
    `on_add` sees each new member; `on_size(size, peak)` each change of size. One event loop."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        make: Callable[[], H],
        retire: Callable[[H], Awaitable[None]],
        queue_depth: Callable[[], int],
        interval_s: float,
        on_add: Callable[[Member[H]], None] | None = None,
        on_size: Callable[[int, int], None] | None = None,
    ) -> None:
        self.autoscaler = autoscaler
        self._make = make
        self._retire = retire
        self._queue_depth = queue_depth
        self.interval_s = interval_s
        self._on_add = on_add
        self._on_size = on_size
        self.members: list[Member[H]] = []
        self.peak = 0
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.members)

    def start(self) -> None:
        """The minimum number of actors, and the scaling loop."""
        for _ in range(self.autoscaler.min_replicas):
            self.add()
        self._task = asyncio.ensure_future(self._scale_loop())

    def add(self) -> Member[H]:
        member = Member(self._make())
        self.members.append(member)
        self.peak = max(self.peak, len(self.members))
        self._sized()
        if self._on_add is not None:
            self._on_add(member)
        return member

    def discard(self, member: Member[H]) -> None:
        """Forget a member without retiring it (its owner does, or it is gone)."""
        if member in self.members:
            self.members.remove(member)
            self._sized()

    def least_loaded(self, started_only: bool = False) -> Member[H] | None:
        """The member with the least work in flight (among the started ones), None when there is none."""
        candidates = [m for m in self.members if m.started or not started_only]
        return min(candidates, key=lambda m: m.in_flight) if candidates else None

    async def scale(self) -> None:
        """One scaling decision: start the missing actors, or retire one idle actor too many."""
        want = self.autoscaler.desired(len(self.members), self._queue_depth())
        while len(self.members) < want:
            self.add()
        if len(self.members) > want:
            idle = [m for m in self.members if m.in_flight == 0]
            if idle:
                self.discard(idle[-1])
                await self._retire(idle[-1].handle)

    async def close(self) -> None:
        """Stop scaling and retire every actor."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        while self.members:
            member = self.members.pop()
            self._sized()
            await self._retire(member.handle)

    async def _scale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scale()

    def _sized(self) -> None:
        if self._on_size is not None:
            self._on_size(len(self.members), self.peak)
