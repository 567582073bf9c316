"""gRPC interceptors shared by every service.

Server side, one interceptor wraps every method handler to:
- parse request bytes itself, so malformed input is INVALID_ARGUMENT (grpc would say INTERNAL);
- reject new work with UNAVAILABLE while the service is not ready or is draining;
- open a SERVER span whose parent comes from the caller's traceparent metadata;
- count requests and time them for Prometheus;
- map ServiceError to its status and any other exception to INTERNAL, logged with the trace id.
Client side, interceptors put the current trace context into outgoing metadata.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from services.kit import telemetry
from services.kit.errors import InvalidArgument, ServiceError

log = logging.getLogger("looprl.rpc")

RPC_REQUESTS = Counter("looprl_rpc_requests_total", "RPCs handled", ["service", "method", "code"])
RPC_SECONDS = Histogram(
    "looprl_rpc_duration_seconds",
    "RPC handling time",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RPC_IN_FLIGHT = Gauge("looprl_rpc_in_flight", "RPCs being handled", ["service"])

# Always answered, even before ready and while draining.
ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """See module docstring. `gate()` returns None when new work is accepted, else the reason."""

    def __init__(self, service: str, gate: Callable[[], str | None]) -> None:
        self.service = service
        self.gate = gate
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(ALWAYS_OPEN):
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
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
            behavior = handler.unary_unary

            async def unary_unary(raw, context):
                async with self._rpc(method, context):
                    return await behavior(parse(raw, "request"), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)
        if handler.unary_stream:
            behavior = handler.unary_stream

            async def unary_stream(raw, context):
                async with self._rpc(method, context):
                    async for item in _responses(behavior(parse(raw, "request"), context)):
                        yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)
        if handler.stream_unary:
            behavior = handler.stream_unary

            async def stream_unary(raw_iter, context):
                async with self._rpc(method, context):
                    return await behavior(parse_stream(raw_iter), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)
        behavior = handler.stream_stream

        async def stream_stream(raw_iter, context):
            async with self._rpc(method, context):
                async for item in _responses(behavior(parse_stream(raw_iter), context)):
                    yield item

        return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

    def _rpc(self, method: str, context: grpc.aio.ServicerContext) -> _RpcScope:
        return _RpcScope(self, method, context)


class _RpcScope:
    """Tracing, metrics, gating and error mapping around one RPC."""

    def __init__(self, owner: ServerInterceptor, method: str, context: grpc.aio.ServicerContext) -> None:
        self.owner, self.method, self.context = owner, method, context

    async def __aenter__(self) -> None:
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
        RPC_SECONDS.labels(self.owner.service, self.method).observe(time.perf_counter() - self.start)
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


class _TraceClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds the current trace context to outgoing metadata."""

    @staticmethod
    def _details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = list(details.metadata or ())
        metadata.extend(telemetry.grpc_metadata())
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def client_interceptors() -> list[Any]:
    return [_TraceClientInterceptor()]
