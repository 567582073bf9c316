"""Reporting a component's errors to the run they concern, not only to its log.

A service that fails work for a run (an episode, a weight push) calls `RunErrorReporter.report`;
the RunError goes to `looprl.<run>.events`, where the gateway keeps the last one in the run record
and names it when the run stops progressing. Failures come in bursts (every episode of a step
fails the same way), so a reporter sends at most one message per run every `interval_s` and
counts the occurrences in between into the next; a burst's last error is always sent. A fatal
report (the component gave up on the run) goes out at once, and the gateway fails the run with it.
Reporting never raises: a bus that is down costs the report, never the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from looprl.events.v1 import events_pb2
from services.kit.bus import subjects

if TYPE_CHECKING:
    from services.kit.bus.client import Bus

log = logging.getLogger("looprl.kit.run_errors")

# Longest message kept: a stack trace's last line is the part worth showing.
MAX_MESSAGE_CHARS = 1000


@dataclass
class _Pending:
    message: str
    occurrences: int
    unix_time: float
    fatal: bool = False


def describe(exc: BaseException) -> str:
    """One line for an exception: a gRPC error's status and details, else its type and message."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        with contextlib.suppress(Exception):
            return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"


class RunErrorReporter:
    """Rate-limited RunError publisher of one component (one instance per service process)."""

    def __init__(self, bus: Bus, component: str, interval_s: float = 2.0) -> None:
        self.bus, self.component, self.interval_s = bus, component, interval_s
        self._last_sent: dict[str, float] = {}
        self._pending: dict[str, _Pending] = {}
        self._flushes: dict[str, asyncio.Task] = {}
        self.sent = 0

    async def report(self, run_id: str, message: str, fatal: bool = False) -> None:
        """Count one error of `run_id`; sent now, or with the next report at most interval_s later.
        fatal: this component gives up on the run; sent now, and the gateway fails the run."""
        if not run_id:
            return
        message = message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."
        pending = self._pending.get(run_id)
        occurrences = pending.occurrences + 1 if pending else 1
        self._pending[run_id] = _Pending(message, occurrences, time.time(), fatal)
        wait = self._last_sent.get(run_id, float("-inf")) + self.interval_s - time.monotonic()
        if wait <= 0 or fatal:
            await self._send(run_id)
        elif run_id not in self._flushes:
            self._flushes[run_id] = asyncio.ensure_future(self._flush_later(run_id, wait))

    async def _flush_later(self, run_id: str, wait: float) -> None:
        try:
            await asyncio.sleep(wait)
            await self._send(run_id)
        finally:
            self._flushes.pop(run_id, None)

    async def _send(self, run_id: str) -> None:
        pending = self._pending.pop(run_id, None)
        if pending is None:
            return
        self._last_sent[run_id] = time.monotonic()
        event = events_pb2.RunError(
            run_id=run_id,
            component=self.component,
            message=pending.message,
            occurrences=pending.occurrences,
            unix_time=pending.unix_time,
            fatal=pending.fatal,
        )
        try:
            await self.bus.publish(subjects.events(run_id), event, timeout_s=5.0)
            self.sent += 1
        except Exception as exc:  # the report is lost, the work goes on
            log.warning("run %s: could not report %s's error: %s", run_id, self.component, exc)

    async def close(self) -> None:
        """Send what is still pending (before the bus drains)."""
        for task in list(self._flushes.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for run_id in list(self._pending):
            await self._send(run_id)
