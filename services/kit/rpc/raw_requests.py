"""Register a generated servicer with some client-streaming methods receiving raw request bytes.

Protobuf copies a bytes field when it parses a message and again on every access of the field. For
methods whose messages carry large payloads (weight buckets, pushed weight shards) the handler gets
the request bytes as received instead and decodes them itself, leaving the payloads in place
(services/weights/wire.py). Interceptors that parse requests themselves
(services.kit.rpc.interceptors) pass raw bytes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc


class _Captured:
    """Stands in for a server to collect the handlers the generated code registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self.service = service
        self.handlers = dict(handlers)


def add_with_raw_requests(
    server: Any,
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    raw_methods: Iterable[str],
) -> None:
    """Like `add_to_server(servicer, server)`, but each of `raw_methods` (client-streaming) receives
    its requests as bytes; its handler must accept them."""
    captured = _Captured()
    add_to_server(servicer, captured)
    for name in raw_methods:
        handler = captured.handlers[name]
        if not handler.request_streaming or handler.response_streaming:
            raise ValueError(f"{captured.service}/{name}: only client-streaming methods take raw requests")
        captured.handlers[name] = grpc.stream_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(captured.service, captured.handlers),)
    )
    server.add_registered_method_handlers(captured.service, captured.handlers)
