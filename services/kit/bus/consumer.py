"""Consuming from the event bus: a durable pull consumer (`Consumer`, made by `Bus.pull_consumer`)
and the messages it hands out (`Delivery`: ack / nak / term / in_progress, the producer's trace
context, a CONSUMER span per message or per producer batch). JetStream's delivery semantics are
described in services.kit.bus.client.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer

from services.kit.bus.errors import BusError, PoisonMessage

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
M = TypeVar("M", bound=Message)


class Consumer:
    """A bound pull subscription on one durable consumer."""

    def __init__(
        self,
        stream: str,
        durable: str,
        sub: JetStreamContext.PullSubscription,
        nc: NatsClient,
        tracer: Tracer,
        open_consumers: weakref.WeakSet[Consumer],
    ) -> None:
        self.stream = stream
        self.durable = durable
        self._sub = sub
        self._nc = nc
        self._tracer = tracer
        # The connection's open consumers, which its drain closes first: this one leaves on close.
        self._open = open_consumers

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Delivery]:
        """Up to batch deliveries, waiting at most timeout seconds; [] when none came."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if timeout <= 0:
            raise ValueError(f"fetch timeout must be > 0 seconds, got {timeout}")
        try:
            msgs = await self._sub.fetch(batch, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        return [Delivery(m, self._nc, self._tracer) for m in msgs]

    async def info(self) -> api.ConsumerInfo:
        """Server-side state: num_pending (not yet delivered), num_ack_pending, num_redelivered."""
        return await self._sub.consumer_info()

    async def close(self) -> None:
        """Stop pulling on this connection; the durable consumer stays on the server."""
        self._open.discard(self)
        try:
            await self._sub.unsubscribe()
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionDrainingError,
            nats.errors.BadSubscriptionError,
        ):
            pass

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A follower cancelled mid-fetch leaves its subscription behind, and draining the
        # connection then waits on it until the drain timeout.
        await self.close()


# --------------------------------------------------------------------------------------------
# deliveries


class Delivery:
    """One JetStream message handed to a consumer; settle it exactly once with ack, nak or term."""

    def __init__(self, msg: Msg, nc: NatsClient, tracer: Tracer) -> None:
        self._msg = msg
        self._nc = nc
        self._tracer = tracer
        meta = msg.metadata
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        self.headers: dict[str, str] = dict(msg.headers or {})
        self.msg_id: str | None = self.headers.get(MSG_ID_HEADER)
        self.num_delivered: int = meta.num_delivered
        self.stream_seq: int = meta.sequence.stream
        self.settled: str | None = None
        """None until settled; then 'ack', 'nak' or 'term'."""
        self.timer_started: float = time.monotonic()
        """When the server's ack_wait timer for it last (re)started: its delivery or in_progress()."""

    def __repr__(self) -> str:
        return (
            f"Delivery({self.subject} seq={self.stream_seq} id={self.msg_id} "
            f"delivered={self.num_delivered} settled={self.settled})"
        )

    async def ack(self, *, confirm: bool = True, timeout: float = 5.0) -> None:
        """Acknowledge: the server will not deliver this message again. A second call is a no-op.

        With confirm (default) this waits for the server to record the ack, so a crash right
        after cannot cause a redelivery of work that was already handed off.
        """
        if self.settled is not None:
            return
        try:
            if confirm:
                await self._msg.ack_sync(timeout=timeout)
            else:
                await self._msg.ack()
        except nats.errors.MsgAlreadyAckdError:
            pass
        except (TimeoutError, nats.errors.TimeoutError) as err:
            raise BusError(
                f"ack of {self.subject} seq {self.stream_seq} not confirmed within {timeout:g}s; "
                "it may be redelivered"
            ) from err
        self.settled = "ack"

    @staticmethod
    async def ack_all(deliveries: Sequence[Delivery], *, timeout: float = 5.0) -> None:
        """Acknowledge deliveries of ONE consumer with a single confirmation: every ack but the last
        is sent without waiting, the last one confirmed. The server takes a connection's messages in
        order and a consumer's acks in order, so the confirmed last ack means every earlier one was
        recorded too: one round trip instead of one per message (a trained step acks thousands)."""
        pending = [d for d in deliveries if d.settled is None]
        if not pending:
            return
        consumers = {(d._msg.metadata.stream, d._msg.metadata.consumer) for d in pending}
        if len(consumers) > 1:
            raise ValueError(f"ack_all: deliveries of several consumers {sorted(consumers)}")
        for d in pending[:-1]:
            await d.ack(confirm=False)
        await pending[-1].ack(timeout=timeout)

    async def nak(self, delay: float | None = None) -> None:
        """Hand the message back for redelivery, after delay seconds if given. No-op once settled."""
        if self.settled is not None:
            return
        await self._msg.nak(delay=delay)
        self.settled = "nak"

    async def term(self, reason: str) -> None:
        """Give up on this message for good (a poison message): never redelivered. No-op once settled.

        The reason is logged here and sent to the server, which reports it in its
        MSG_TERMINATED advisory.
        """
        if self.settled is not None:
            return
        one_line = " ".join(reason.split())[:256] or "terminated"
        log.warning(
            "terminating %s seq %s (id %s, delivery %d): %s",
            self.subject,
            self.stream_seq,
            self.msg_id,
            self.num_delivered,
            one_line,
        )
        await self._nc.publish(self._msg.reply, b"+TERM " + one_line.encode())
        self.settled = "term"

    async def in_progress(self) -> None:
        """Reset the ack_wait timer for long work; may be called repeatedly until settled."""
        if self.settled is not None:
            return
        await self._msg.in_progress()
        self.timer_started = time.monotonic()

    def parse(self, message_type: type[M]) -> M:
        """The payload as a protobuf message; PoisonMessage when it does not parse."""
        try:
            return message_type.FromString(self.data)
        except DecodeError as err:
            raise PoisonMessage(
                f"{self.subject} seq {self.stream_seq}: payload of {len(self.data)} bytes is not a valid "
                f"{message_type.DESCRIPTOR.full_name}: {err}"
            ) from err

    async def parse_or_term(self, message_type: type[M]) -> M | None:
        """The payload as a protobuf message; None after terming a payload that does not parse,
        which no redelivery would fix."""
        try:
            return self.parse(message_type)
        except PoisonMessage as exc:
            await self.term(str(exc))
            return None

    def producer_context(self) -> SpanContext | None:
        """The publisher's span (from the traceparent header), to link to; None when none came."""
        ctx = trace.get_current_span(propagate.extract(self.headers)).get_span_context()
        return ctx if ctx.is_valid else None

    @contextmanager
    def process_span(
        self, name: str | None = None, *, new_trace: bool = False, attributes: Mapping[str, Any] | None = None
    ) -> Iterator[Span]:
        """A CONSUMER span "<subject> process" whose parent is the publisher's span; with new_trace
        the root of a new trace instead, linked to the publisher's span (work that deserves its own
        trace, such as one episode of a run)."""
        attrs: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.destination.name": self.subject,
            "messaging.nats.stream_sequence": self.stream_seq,
            "messaging.nats.num_delivered": self.num_delivered,
            **(attributes or {}),
        }
        if self.msg_id:
            attrs["messaging.message.id"] = self.msg_id
        producer = self.producer_context()
        if new_trace:
            parent = Context()
            links = [Link(producer)] if producer is not None else []
        else:
            parent, links = propagate.extract(self.headers), []
        with self._tracer.start_as_current_span(
            name or f"{self.subject} process",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            links=links,
        ) as span:
            yield span


@contextmanager
def batch_process_span(
    deliveries: Sequence[Delivery], attributes: Mapping[str, Any] | None = None
) -> Iterator[Span]:
    """One CONSUMER span "<subject> process" for messages that came from one producer span (a
    `publish_batch`): parented on it, so the consume stays in the producer's trace, at one span
    per batch instead of one per message. All deliveries must share subject and producer."""
    first = deliveries[0]
    ids = [d.msg_id for d in deliveries if d.msg_id]
    attrs: dict[str, Any] = {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": first.subject,
        "messaging.batch.message_count": len(deliveries),
        "messaging.nats.num_delivered": max(d.num_delivered for d in deliveries),
        **(attributes or {}),
    }
    if ids:
        attrs["messaging.message.id"] = ",".join(ids)
    with first._tracer.start_as_current_span(
        f"{first.subject} process",
        context=propagate.extract(first.headers),
        kind=SpanKind.CONSUMER,
        attributes=attrs,
    ) as span:
        yield span


def by_producer(deliveries: Sequence[Delivery]) -> list[list[Delivery]]:
    """Deliveries grouped by the producer span that published them (first-seen order)."""
    groups: dict[tuple[str, str], list[Delivery]] = {}
    for d in deliveries:
        groups.setdefault((d.subject, (d.headers or {}).get("traceparent", "")), []).append(d)
    return list(groups.values())
