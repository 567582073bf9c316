"""The event bus every service uses: a small, honest wrapper over nats-py JetStream.

What it gives a service:

- `Bus.connect(url, name=...)`: one NATS connection with sane reconnects; a clear BusUnavailable
  when no server answers within the connect timeout.
- `ensure_streams()`: idempotent provisioning (from code) of the streams and KV buckets named in
  services.kit.bus.subjects.
- `publish(subject, payload, msg_id=...)`: JetStream publish that waits for the stream's ack,
  sets Nats-Msg-Id for server-side dedup and carries the W3C trace context in the headers inside
  a PRODUCER span "<subject> publish".
- `pull_consumer(stream, durable, filter_subject, ...)`: durable pull consumers with explicit ack;
  `fetch()` returns `Delivery` objects with ack / nak / term / in_progress and a CONSUMER span
  "<subject> process" parented on the producer's span (or, for work that starts its own trace,
  a root span linked to it).
- `kv(bucket)`: get / put / compare-and-set update / keys / watch on a JetStream KV bucket.

JetStream semantics this wrapper does not hide:

- Delivery is at-least-once. A message is redelivered when it is not acked within ack_wait (or
  the backoff schedule), when it is nak'ed, or when its consumer dies holding it. Ack only after
  the work is durably handed off; call `in_progress()` during work that may outlast ack_wait.
- Nats-Msg-Id dedup only covers the stream's duplicate window (2 minutes by default). A publish
  retried later, or a redelivery, reaches consumers twice, so consumers must also dedup by id
  (rollout_id, episode id) wherever a duplicate would do harm.
- After max_deliver attempts the server stops delivering a message; on a WorkQueue stream it then
  stays in the stream unacked. Use `term(reason)` for messages that can never succeed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import Message
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, TracerProvider

from services.kit.bus import streams as bus_streams
from services.kit.bus import subjects as names
from services.kit.bus.consumer import (
    MSG_ID_HEADER,
    Consumer,
)
from services.kit.bus.errors import BusError, BusUnavailable, KVConflict, PoisonMessage
from services.kit.bus.kv import KV, KVEntry, KVWatch
from services.kit.bus.streams import DEFAULT_DUPLICATE_WINDOW_S

log = logging.getLogger(__name__)

__all__ = [
    "KV",
    "Bus",
    "BusError",
    "BusUnavailable",
    "KVConflict",
    "KVEntry",
    "KVWatch",
    "PoisonMessage",
]

# How long a producer retries an event that nothing would publish again (a step record, a delivered
# version) through a nats-server restart: well inside the duplicate window, so a retry of a publish
# that was in fact stored is dropped as a duplicate.
EVENT_RETRY_S = 60.0

M = TypeVar("M", bound=Message)


# What a NATS call raises while the server restarts or JetStream is not back yet: worth retrying.
BUS_UNAVAILABLE: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
)


class Bus:
    """One NATS connection with its JetStream context. Create with `await Bus.connect(...)`."""

    def __init__(
        self,
        nc: NatsClient,
        name: str,
        tracer_provider: TracerProvider | None = None,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=request_timeout_s)
        self.name = name
        self._tracer = trace.get_tracer("looprl.bus", tracer_provider=tracer_provider)
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        connect_timeout_s: float = 5.0,
        reconnect_wait_s: float = 1.0,
        max_reconnect_attempts: int = -1,
        request_timeout_s: float = 5.0,
        tracer_provider: TracerProvider | None = None,
    ) -> Bus:
        """Connect to NATS at url (comma-separated for several servers).

        Tries for up to connect_timeout_s; then raises BusUnavailable. Once connected, a lost
        connection is retried every reconnect_wait_s, forever by default (-1): a service rides
        out a NATS restart rather than dying with it; publishes during the outage are buffered
        or time out with an error.
        """
        servers = [u.strip() for u in url.split(",") if u.strip()]
        if not servers:
            raise ValueError("nats url is empty")
        where = redact(url)  # URLs carry the service's NATS password: never log it
        # nats-py uses one attempt budget for the first connect and for later reconnects; bound the
        # first connect by the timeout and lift the bound once connected.
        first_attempts = max(1, math.ceil(connect_timeout_s / max(reconnect_wait_s, 0.05)))

        refused: list[Exception] = []  # the server's answers to our credentials, if it refused them

        async def on_error(err: Exception) -> None:
            if isinstance(err, nats.errors.AuthorizationError) or "Authorization Violation" in str(err):
                refused.append(err)
            log.warning("nats %s: %s", name, err or type(err).__name__)

        async def on_disconnected() -> None:
            if not nc.is_closed:  # a deliberate close() or drain() is not news
                log.warning("nats %s: disconnected from %s; reconnecting", name, where)

        async def on_reconnected() -> None:
            log.info("nats %s: reconnected to %s", name, _server(nc))

        nc = NatsClient()
        try:
            await nc.connect(
                servers=servers,
                name=name,
                connect_timeout=max(1, math.ceil(min(connect_timeout_s, 5.0))),
                # nats-py annotates an int, and sleeps whatever it is given.
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                max_reconnect_attempts=first_attempts,
                allow_reconnect=True,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            )
        except nats.errors.AuthorizationError as err:
            raise BusUnavailable(f"NATS at {where} refused the credentials of {name!r}: {err}") from err
        except (TimeoutError, nats.errors.NoServersError, OSError) as err:
            if refused:
                raise BusUnavailable(
                    f"NATS at {where} refused the credentials of {name!r}: {refused[-1]}"
                ) from err
            raise BusUnavailable(
                f"cannot reach NATS at {where} within {connect_timeout_s:g}s ({type(err).__name__}); "
                "is nats-server running with JetStream (-js)?"
            ) from err
        nc.options["max_reconnect_attempts"] = max_reconnect_attempts
        return cls(nc, name, tracer_provider, request_timeout_s)

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    async def drain(self) -> None:
        """Finish in-flight subscriptions and publishes, then close. Safe to call twice.

        Pull consumers still open are closed first: a message the server sent to a fetch that gave
        up or was cancelled waits in the subscription for a fetch that never comes, and the
        connection's drain would wait for it until its timeout. Unacked, it is redelivered."""
        if self.nc.is_closed:
            return
        for consumer in list(self._consumers):
            await consumer.close()
        try:
            await self.nc.drain()
        except nats.errors.ConnectionClosedError:
            pass

    async def close(self) -> None:
        """Close now, without draining. Unacked deliveries are redelivered after their ack_wait."""
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    # ----------------------------------------------------------------------------------------
    # provisioning

    async def ensure_streams(
        self,
        streams: Sequence[names.StreamSpec] = names.STREAMS,
        buckets: Sequence[names.BucketSpec] = names.BUCKETS,
        *,
        duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
        replicas: int = 1,
    ) -> None:
        """Create the streams and KV buckets, or bring existing ones to this configuration
        (services.kit.bus.streams.ensure_streams)."""
        await bus_streams.ensure_streams(
            self.js,
            _server(self.nc),
            streams,
            buckets,
            duplicate_window_s=duplicate_window_s,
            replicas=replicas,
        )

    # ----------------------------------------------------------------------------------------
    # publish

    async def publish(
        self,
        subject: str,
        payload: bytes | Message,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> api.PubAck:
        """Publish to JetStream and wait for the stream to store it.

        msg_id sets Nats-Msg-Id: a second publish with the same id inside the stream's duplicate
        window is not stored again and its PubAck has duplicate=True. Raises BusError when no
        stream stores the subject.
        """
        return (await self.publish_batch(subject, [(payload, msg_id)], headers, timeout_s=timeout_s))[0]

    async def publish_retrying(
        self,
        subject: str,
        payload: bytes | Message,
        msg_id: str,
        headers: Mapping[str, str] | None = None,
        *,
        within_s: float,
        timeout_s: float = 5.0,
    ) -> api.PubAck:
        """`publish`, tried again while the bus is unavailable (a nats-server restarting, JetStream
        not back yet) for up to `within_s`, then the last error is raised. For a message whose loss
        nothing would notice later. The message id turns a retry of a publish that was in fact stored
        into a duplicate the stream drops, so the retries must end inside the duplicate window."""
        if not msg_id:
            raise ValueError("msg_id: a retried publish needs one, or the stream may store it twice")
        if not 0 < within_s < DEFAULT_DUPLICATE_WINDOW_S:
            raise ValueError(
                f"within_s: {within_s} is outside (0, {DEFAULT_DUPLICATE_WINDOW_S}), the duplicate window"
            )
        deadline = time.monotonic() + within_s
        delay = 0.25
        while True:
            try:
                return await self.publish(
                    subject, payload, msg_id=msg_id, headers=headers, timeout_s=timeout_s
                )
            except BUS_UNAVAILABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("publish to %s: the bus did not answer (%r); again in %.2fs", subject, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    async def publish_batch(
        self,
        subject: str,
        messages: Sequence[tuple[bytes | Message, str | None]],
        headers: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[api.PubAck]:
        """Publish (payload, msg_id) pairs concurrently under one PRODUCER span, as `publish` does
        one: the messages of one piece of work (a group's rollouts) cost one span, not one each,
        and every message carries that span's context."""
        datas = [p.SerializeToString() if isinstance(p, Message) else bytes(p) for p, _ in messages]
        for _, msg_id in messages:
            if msg_id is not None and not msg_id:
                raise ValueError("msg_id must be a non-empty string or None")
        attributes: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "publish",
            "messaging.destination.name": subject,
            "messaging.message.body.size": sum(len(d) for d in datas),
        }
        ids = [m for _, m in messages if m]
        if len(messages) > 1:
            attributes["messaging.batch.message_count"] = len(messages)
        if ids:
            attributes["messaging.message.id"] = ids[0] if len(ids) == 1 else ",".join(ids)
        with self._tracer.start_as_current_span(
            f"{subject} publish", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            base: dict[str, str] = dict(headers or {})
            propagate.inject(base)
            sends = [
                self._send(subject, d, base, m, timeout_s) for d, (_, m) in zip(datas, messages, strict=True)
            ]
            acks = [await sends[0]] if len(sends) == 1 else list(await asyncio.gather(*sends))
            if len(acks) == 1:
                span.set_attribute("messaging.nats.stream", acks[0].stream)
                span.set_attribute("messaging.nats.stream_sequence", acks[0].seq)
            duplicates = sum(1 for a in acks if a.duplicate)
            if duplicates:
                span.set_attribute("messaging.nats.duplicate", True)
                if len(acks) > 1:
                    span.set_attribute("messaging.nats.duplicates", duplicates)
        return acks

    async def _send(
        self, subject: str, data: bytes, headers: dict[str, str], msg_id: str | None, timeout_s: float | None
    ) -> api.PubAck:
        hdrs = {**headers, MSG_ID_HEADER: msg_id} if msg_id else headers
        try:
            return await self.js.publish(subject, data, timeout=timeout_s, headers=hdrs or None)
        except nats.js.errors.NoStreamResponseError as err:
            raise BusError(
                f"no JetStream stream stores subject {subject!r}; call Bus.ensure_streams() first"
            ) from err
        except nats.errors.MaxPayloadError as err:
            raise BusError(
                f"message for {subject!r} is {len(data)} bytes, over the server's max_payload "
                f"({self.nc.max_payload} bytes)"
            ) from err

    # ----------------------------------------------------------------------------------------
    # consume

    async def pull_consumer(
        self,
        stream: str,
        durable: str,
        filter_subject: str,
        *,
        ack_wait: float = 30.0,
        max_deliver: int = 5,
        backoff: Sequence[float] | None = None,
        max_ack_pending: int = 1000,
        deliver_new_only: bool = False,
    ) -> Consumer:
        """A durable pull consumer (created, or updated to this configuration, on the server).

        Several processes using the same durable share its messages (each delivered to one of
        them). ack_wait: seconds a delivery may stay unacked before the server redelivers it; set
        it above the longest processing time or call Delivery.in_progress(). max_deliver bounds
        the attempts (-1: unbounded). backoff (seconds per redelivery attempt) replaces ack_wait
        for redeliveries and needs max_deliver > len(backoff). max_ack_pending caps the deliveries
        outstanding at once across all processes of this durable.
        """
        names.validate_durable(durable)
        if ack_wait <= 0:
            raise ValueError(f"ack_wait must be > 0 seconds, got {ack_wait}")
        if max_deliver == 0 or max_deliver < -1:
            raise ValueError(f"max_deliver must be >= 1 or -1 (unbounded), got {max_deliver}")
        if backoff is not None:
            backoff = [float(b) for b in backoff]
            if not backoff or any(b <= 0 for b in backoff):
                raise ValueError(f"backoff must be a non-empty list of positive seconds, got {backoff}")
            if max_deliver != -1 and max_deliver <= len(backoff):
                raise ValueError(
                    f"max_deliver ({max_deliver}) must exceed the number of backoff steps ({len(backoff)})"
                )
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            backoff=backoff,
            filter_subject=filter_subject,
            max_ack_pending=max_ack_pending,
            deliver_policy=api.DeliverPolicy.NEW if deliver_new_only else api.DeliverPolicy.ALL,
        )
        try:
            await self.js.add_consumer(stream, config)
        except nats.js.errors.NotFoundError as err:
            raise BusError(f"stream {stream} does not exist; call Bus.ensure_streams() first") from err
        except nats.js.errors.APIError as err:
            raise BusError(f"cannot create consumer {durable} on stream {stream}: {err.description}") from err
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        consumer = Consumer(stream, durable, sub, self.nc, self._tracer, self._consumers)
        self._consumers.add(consumer)
        return consumer

    async def delete_consumer(self, stream: str, durable: str) -> bool:
        """Remove a durable consumer; False when it did not exist."""
        try:
            return await self.js.delete_consumer(stream, durable)
        except nats.js.errors.NotFoundError:
            return False

    async def count(self, stream: str, subject: str | None = None) -> int:
        """Messages stored in a stream, or on one subject of it (e.g. a run's episode backlog)."""
        info = await self.js.stream_info(stream, subjects_filter=subject)
        if subject is None:
            return info.state.messages
        return (info.state.subjects or {}).get(subject, 0)

    # ----------------------------------------------------------------------------------------
    # key-value

    async def kv(self, bucket: str) -> KV:
        """A KV bucket created by ensure_streams (or by hand)."""
        try:
            store = await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError as err:
            raise BusError(f"KV bucket {bucket!r} does not exist; call Bus.ensure_streams() first") from err
        return KV(bucket, store, self.js)


def redact(url: str) -> str:
    """The NATS URL(s) without user and password."""
    return re.sub(r"//[^@/,]*@", "//", url)


def _server(nc: NatsClient) -> str:
    u = nc.connected_url
    return f"{u.hostname}:{u.port}" if u else "?"
