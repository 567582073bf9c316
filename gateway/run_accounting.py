"""A run's accounting, written in batches: the record changes, step history and weight deliveries
the driver gathers over FLUSH_S go out together (one compare-and-set of the record, one write per
history chunk touched), and only then are the bus deliveries they came from acked.

Written one by one, each step of the default recipe (~10 steps/s) cost three record writes and two
chunk rewrites, and every record write reached each service watching the "runs" bucket (router,
trainer, packer), all of it while the next step generated. Acking after the writes keeps a crash
harmless: a gateway that dies in between leaves the deliveries unacked, they come again, and every
change applies idempotently (history by step, deliveries by version and deployment, counters by
counted step ranges)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.run_store import RunStore
from services.kit.bus import Delivery
from services.kit.recipe import RunRecord

# How long a change waits for the ones after it. A reader sees a run at most this much behind its
# bus events; WatchRun polls the record every 0.5 s, so a user notices no difference.
FLUSH_S = 0.5

Change = Callable[[RunRecord], None]


class RunAccounting:
    """What the driver learned about one run and has not written yet."""

    def __init__(self, store: RunStore, run_id: str, flush_s: float = FLUSH_S) -> None:
        self.store, self.run_id, self.flush_s = store, run_id, flush_s
        self._changes: list[Change] = []
        self._history: list[dict] = []
        self._syncs: list[dict] = []
        self._acks: dict[str, list[Delivery]] = {}  # by consumer: each is acked with one confirmation
        self._due = asyncio.Event()
        self._lock = asyncio.Lock()

    def add(
        self,
        change: Change | None = None,
        *,
        history: dict | None = None,
        sync: dict | None = None,
        ack: tuple[str, Delivery] | None = None,
    ) -> None:
        """Queue a record change, a history entry, a weight delivery and/or the delivery to ack once
        they are written (`ack`: the consumer's name and the delivery)."""
        if change is not None:
            self._changes.append(change)
        if history is not None:
            self._history.append(history)
        if sync is not None:
            self._syncs.append(sync)
        if ack is not None:
            self._acks.setdefault(ack[0], []).append(ack[1])
        self._due.set()

    async def run(self) -> None:
        """Write what gathered, FLUSH_S after the first change of each batch (a driver task)."""
        while True:
            await self._due.wait()
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Write everything queued, then ack its deliveries. On a failure the writes are queued
        again (the deliveries stay unacked), and the error propagates."""
        async with self._lock:
            self._due.clear()
            changes, history, syncs, acks = self._changes, self._history, self._syncs, self._acks
            self._changes, self._history, self._syncs, self._acks = [], [], [], {}
            try:
                if history:
                    await self.store.add_history(self.run_id, *history)
                if syncs:
                    await self.store.add_weight_syncs(self.run_id, *syncs)
                if changes:
                    await self.store.update(self.run_id, lambda record: [c(record) for c in changes])
            except BaseException:
                self._changes[:0], self._history[:0], self._syncs[:0] = changes, history, syncs
                for consumer, deliveries in acks.items():
                    self._acks.setdefault(consumer, [])[:0] = deliveries
                self._due.set()
                raise
            for deliveries in acks.values():
                await Delivery.ack_all(deliveries)
