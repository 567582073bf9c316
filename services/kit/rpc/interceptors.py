"""gRPC interceptors shared by every service.

Server side, one interceptor wraps every method handler to:
- parse request bytes itself, so malformed input is INVALID_ARGUMENT (grpc would say INTERNAL);
- refuse callers services/kit/rpc/authz.py does not allow (UNAUTHENTICATED without a verified client
  certificate, PERMISSION_DENIED for another identity), when the server runs with mutual TLS;
- reject new work with UNAVAILABLE while the service is not ready or is draining;
- open a SERVER span whose parent comes from the caller's traceparent metadata;
- count requests and time them for Prometheus;
- map ServiceError to its status and any other exception to INTERNAL, logged with the trace id.
Client side, interceptors open a CLIENT span per outgoing call (so trace views draw the edge
between two services) and put its context into the call's metadata.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.kit.rpc import authz, tls
from services.kit.rpc.errors import InvalidArgument, ServiceError
from services.kit.telemetry import metrics as metric_names
from services.kit.telemetry import tracing as telemetry

log = logging.getLogger("looprl.rpc")

RPC_REQUESTS = metric_names.counter("looprl_rpc_requests_total")
RPC_SECONDS = metric_names.histogram("looprl_rpc_duration_seconds")
RPC_IN_FLIGHT = metric_names.gauge("looprl_rpc_in_flight")

# Always answered, even before ready and while draining.
ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """See module docstring. `gate()` returns None when new work is accepted, else the reason."""

    def __init__(self, service: str, gate: Callable[[], str | None], authorize: bool = False) -> None:
        self.service = service
        self.gate = gate
        self.authorize = authorize
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(ALWAYS_OPEN):
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: Any, method: str) -> grpc.RpcMethodHandler:
        # `handler` is an aio handler: its behaviours are coroutines and async generators, which
        # the stubs' RpcMethodHandler (typed for blocking servers) does not describe.
        deserialize = handler.request_deserializer or (lambda b: b)
        short = method.rsplit("/", 1)[-1]

        def parse(raw: bytes, where: str) -> Any:
            try:
                return deserialize(raw)
            except (DecodeError, ValueError, TypeError) as exc:
                raise InvalidArgument(f"{where}: malformed {short} request ({exc})") from exc

        async def parse_stream(raw_iter: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            index = 0
            async for raw in raw_iter:
                yield parse(raw, f"request message {index}")
                index += 1

        serialize = handler.response_serializer
        if handler.unary_unary:
            unary = handler.unary_unary

            async def unary_unary(raw, context):
                async with self._rpc(method, context):
                    return await unary(parse(raw, "request"), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)
        if handler.unary_stream:
            streaming = handler.unary_stream

            async def unary_stream(raw, context):
                async with self._rpc(method, context):
                    async for item in _responses(streaming(parse(raw, "request"), context)):
                        yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)
        if handler.stream_unary:
            streamed = handler.stream_unary

            async def stream_unary(raw_iter, context):
                async with self._rpc(method, context):
                    return await streamed(parse_stream(raw_iter), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)
        both = handler.stream_stream

        async def stream_stream(raw_iter, context):
            async with self._rpc(method, context):
                async for item in _responses(both(parse_stream(raw_iter), context)):
                    yield item

        return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

    def _rpc(self, method: str, context: grpc.aio.ServicerContext) -> _RpcScope:
        return _RpcScope(self, method, context)


class _RpcScope:
    """Tracing, metrics, gating and error mapping around one RPC."""

    def __init__(self, owner: ServerInterceptor, method: str, context: grpc.aio.ServicerContext) -> None:
        self.owner, self.method, self.context = owner, method, context

    async def __aenter__(self) -> None:
        if self.owner.authorize:
            refused = authz.denial(self.method, tls.peer_identity(self.context))
            if refused is not None:
                code, message = refused
                RPC_REQUESTS.labels(self.owner.service, self.method, code).inc()
                log.warning("refused %s", message)
                await self.context.abort(getattr(grpc.StatusCode, code), message)
        closed = self.owner.gate()
        if closed is not None:
            RPC_REQUESTS.labels(self.owner.service, self.method, "UNAVAILABLE").inc()
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.owner.service} is {closed}")
        metadata = {k: v for k, v in (self.context.invocation_metadata() or ()) if isinstance(v, str)}
        parent = telemetry.extract(metadata)
        self.span = trace.get_tracer("looprl.grpc").start_span(
            self.method.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": self.method},
        )
        self.token = trace.use_span(self.span, end_on_exit=False)
        self.token.__enter__()
        self.start = time.perf_counter()
        self.owner.in_flight += 1
        self.owner.idle.clear()
        RPC_IN_FLIGHT.labels(self.owner.service).inc()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self.owner.in_flight -= 1
        if self.owner.in_flight == 0:
            self.owner.idle.set()
        RPC_IN_FLIGHT.labels(self.owner.service).dec()
        metric_names.observe(
            RPC_SECONDS.labels(self.owner.service, self.method), time.perf_counter() - self.start
        )
        code = "OK"
        try:
            if exc is None:
                return False
            if isinstance(exc, asyncio.CancelledError):
                code = "CANCELLED"
                return False
            if isinstance(exc, ServiceError):
                code = exc.code.name
                self.span.set_status(Status(StatusCode.ERROR, exc.message))
                for key, value in exc.trailing_metadata():
                    self.context.set_trailing_metadata(((key, value),))
                await self.context.abort(exc.code, exc.message)
            if isinstance(exc, grpc.aio.AbortError) or type(exc).__name__ == "AbortError":
                code = (self.context.code() or grpc.StatusCode.UNKNOWN).name
                return False
            code = "INTERNAL"
            trace_id, _ = telemetry.current_ids()
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, repr(exc)))
            log.error(
                "unhandled error in %s: %r",
                self.method,
                exc,
                exc_info=(exc_type, exc, tb),
                extra={"fields": {"method": self.method}},
            )
            await self.context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {self.method} (trace_id={trace_id}): {exc!r}"
            )
        finally:
            RPC_REQUESTS.labels(self.owner.service, self.method, code).inc()
            self.token.__exit__(None, None, None)
            self.span.end()
        return False


async def _responses(result: Any) -> AsyncIterator[Any]:
    """A streaming behaviour is an async generator, or a coroutine writing via context.write."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


_client_tracer = trace.get_tracer("looprl.grpc.client")


def _client_span(method: str) -> Span:
    """A CLIENT span for one outgoing call, a child of the current span."""
    service, _, short = method.lstrip("/").rpartition("/")
    return _client_tracer.start_span(
        method.lstrip("/"),
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": short},
    )


def _outgoing_metadata(metadata: Any, span: Span) -> list[tuple[str, str]]:
    """The call's metadata plus the client span's traceparent."""
    out = [(k, v) for k, v in (metadata or ()) if k.lower() != "traceparent"]
    with trace.use_span(span, end_on_exit=False):
        out.extend(telemetry.grpc_metadata())
    return out


def _end_client_span(span: Span, code: grpc.StatusCode | None, details: str = "") -> None:
    name = (code or grpc.StatusCode.UNKNOWN).name
    span.set_attribute("rpc.grpc.status_code", (code or grpc.StatusCode.UNKNOWN).value[0])
    if code is not None and code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{name}: {details}"[:256]))
    span.end()


_finishing: set[asyncio.Task] = set()


def _background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)


class _AioClientSpans:
    """A CLIENT span around every outgoing call (asyncio channels), its context in the metadata."""

    @staticmethod
    def _details(details: grpc.aio.ClientCallDetails, span: Span) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*_outgoing_metadata(details.metadata, span)),
            details.credentials,
            details.wait_for_ready,
        )

    async def _intercept(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span = _client_span(method)
        if not span.is_recording():  # tracing off: only carry the context on
            return await continuation(self._details(details, span), request)
        try:
            call = await continuation(self._details(details, span), request)
        except BaseException as exc:
            span.record_exception(exc)
            _end_client_span(span, grpc.StatusCode.UNKNOWN, repr(exc))
            raise

        async def finish(finished: Any) -> None:
            try:
                code, detail = await finished.code(), await finished.details()
            except BaseException:  # cancelled before a status arrived
                code, detail = grpc.StatusCode.CANCELLED, ""
            _end_client_span(span, code, detail or "")

        # The status getters of an asyncio call are coroutines; the call is over, so they return at once.
        call.add_done_callback(lambda finished: _background(finish(finished)))
        return call


# grpc.aio files a channel's interceptor under the first call type it implements only: one each.
class _AioUnaryUnary(_AioClientSpans, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _AioUnaryStream(_AioClientSpans, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _AioStreamUnary(_AioClientSpans, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _AioStreamStream(_AioClientSpans, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _SyncCallDetails(
    collections.namedtuple(
        "_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncTraceClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The same CLIENT span for blocking channels (grpc.intercept_channel)."""

    def _intercept(self, continuation, details, request):
        span = _client_span(details.method)
        new = _SyncCallDetails(
            details.method,
            details.timeout,
            _outgoing_metadata(details.metadata, span),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )
        try:
            call = continuation(new, request)
        except BaseException as exc:
            _end_client_span(span, grpc.StatusCode.UNKNOWN, repr(exc))
            raise
        if not span.is_recording():
            span.end()
            return call

        def done(*_: Any) -> None:
            try:
                code, detail = call.code(), call.details()
            except Exception:
                code, detail = grpc.StatusCode.UNKNOWN, ""
            _end_client_span(span, code, detail or "")

        # A blocking unary call is over when the continuation returns; a stream ends later.
        try:
            over = isinstance(call, grpc.Future) and call.done()
        except Exception:
            over = True
        if not over:
            try:
                over = not call.add_callback(done)
            except NotImplementedError:
                over = True
        if over:
            done()
        return call

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)


def client_interceptors() -> list[Any]:
    """For grpc.aio channels: a CLIENT span per call, its context sent in the metadata."""
    return [_AioUnaryUnary(), _AioUnaryStream(), _AioStreamUnary(), _AioStreamStream()]


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """A blocking channel whose calls get CLIENT spans and carry their context."""
    return grpc.intercept_channel(channel, _SyncTraceClientInterceptor())
