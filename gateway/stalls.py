"""Runs that say what is wrong: the errors components report for a run, and the stall watch.

Components publish RunError on `looprl.<run>.events` (services/kit/messages/run_errors.py); the run's
driver keeps the last one in the record (`extra["last_error"]`). A running run that trains no
step, feeds no step and receives no weight version for its recipe's `run.stall_seconds` is marked
stalled (`extra["stalled"]`: why, naming the last error reported since it last progressed); the
public state is then RUN_STATE_STALLED. The record's own state stays "running", since the trainer
and packer follow it and a stalled run must keep every service working on it; the first progress
clears the mark and the run reads RUNNING again. A fatal RunError (the component gave up on the
run, e.g. the trainer after its retries) fails the run with the component's message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.run_store import ACTIVE
from looprl.events.v1 import events_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord

LAST_ERROR_KEY = "last_error"
STALLED_KEY = "stalled"


class ProgressClock:
    """When the run last progressed (monotonic for the watch, wall time to compare with reports)."""

    def __init__(self) -> None:
        self.mark()

    def mark(self) -> None:
        self.monotonic, self.wall = time.monotonic(), time.time()

    def idle_s(self) -> float:
        return time.monotonic() - self.monotonic


def apply_error(record: RunRecord, event: events_pb2.RunError) -> None:
    previous = record.extra.get(LAST_ERROR_KEY) or {}
    record.extra[LAST_ERROR_KEY] = {
        "component": event.component,
        "message": event.message,
        "unix_time": event.unix_time,
        # Occurrences of this component's errors since the run started (reports are batched).
        "occurrences": (
            int(previous.get("occurrences", 0)) if previous.get("component") == event.component else 0
        )
        + max(1, event.occurrences),
    }
    if event.fatal and record.state in ACTIVE:
        fail(record, f"{event.component}: {event.message}")


def fail(record: RunRecord, error: str) -> None:
    """The run ended failed, with why (a failed run is not also stalled)."""
    record.state = "failed"
    record.error = error
    record.extra.pop(STALLED_KEY, None)


def stall_reason(
    record: RunRecord, stall_s: float, progressed_at: float, not_serving: Sequence[str] = ()
) -> str:
    """Why the run is stalled: since when it has been idle, which of its services are not serving,
    and what was reported since it last progressed."""
    total = record.recipe().run.steps
    since = time.strftime("%H:%M:%S UTC", time.gmtime(progressed_at))
    head = f"no progress at step {record.step}/{total} since {since} (run.stall_seconds = {stall_s:g})"
    if not_serving:
        head += f"; not serving: {', '.join(not_serving)}"
    error = record.extra.get(LAST_ERROR_KEY) or {}
    if error and float(error.get("unix_time", 0.0)) >= progressed_at:
        count = int(error.get("occurrences", 1))
        times = f" ({count} errors reported)" if count > 1 else ""
        return f"{head}; {error['component']} reported{times}: {error['message']}"
    return f"{head}; no component reported an error since the last progress"


async def follow_errors(bus: Bus, store, run_id: str, changed: asyncio.Event) -> None:
    """Keep the run's last reported error in its record."""
    consumer = await bus.pull_consumer(
        subjects.RUN_EVENTS, f"gateway-events-{run_id}", subjects.events(run_id), ack_wait=30
    )
    async with consumer:
        while True:
            for delivery in await consumer.fetch(batch=64, timeout=1.0):
                event = await delivery.parse_or_term(events_pb2.RunError)
                if event is None:
                    continue
                await store.update(run_id, lambda r, e=event: apply_error(r, e))
                await delivery.ack()
                changed.set()


async def watch_stalls(
    store,
    run_id: str,
    stall_s: float,
    clock: ProgressClock,
    changed: asyncio.Event,
    not_serving: Callable[[], Awaitable[list[str]]] | None = None,
    period_s: float = 1.0,
) -> None:
    """Mark the run stalled after stall_s without progress (naming the services `not_serving` finds
    down); clear the mark once it progresses."""
    while True:
        await asyncio.sleep(min(period_s, stall_s / 4))
        record = await store.get(run_id)
        if record is None or record.state != "running":
            continue
        stalled = record.extra.get(STALLED_KEY)
        if clock.idle_s() >= stall_s:
            down = await not_serving() if not_serving is not None else []
            reason = stall_reason(record, stall_s, clock.wall, down)
            if reason != stalled:  # written again only when a newer error is named
                await store.update(run_id, _setter(reason))
                changed.set()
        elif stalled:
            await store.update(run_id, _setter(None))
            changed.set()


def _setter(reason: str | None) -> Callable[[RunRecord], None]:
    def change(record: RunRecord) -> None:
        if reason is None:
            record.extra.pop(STALLED_KEY, None)
        elif record.state == "running":
            record.extra[STALLED_KEY] = reason

    return change
