"""OpenTelemetry tracing for every service: provider setup, exporters and context propagation.

Spans go to an OTLP collector when an endpoint is configured (Tempo behind it, seen in
Grafana), and optionally to a JSON-lines file, which is how tests follow one trace across
processes. Context travels as W3C traceparent in gRPC metadata and NATS headers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, MutableMapping, Sequence

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (for tests and offline debugging)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name", ""),
                        "kind": span.kind.name,
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else "",
                        "status": span.status.status_code.name,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "attributes": {k: str(v) for k, v in (span.attributes or {}).items()},
                    }
                )
            )
        with self._lock, open(self._path, "a") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def setup_tracing(service_name: str, otlp_endpoint: str = "", span_log: str = "") -> TracerProvider:
    """Install the global tracer provider once per process; later calls return it."""
    global _provider
    if _provider is not None:
        return _provider
    # With nowhere to send spans, record none: spans are still created (with valid ids, so logs and
    # error messages carry trace ids and traceparent still propagates) but not recorded, which saves
    # a few ms of CPU per loop step across the services. A sampled parent is still followed.
    exporting = bool(otlp_endpoint or span_log)
    sampler = ParentBased(ALWAYS_ON if exporting else ALWAYS_OFF)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True))
        )
    if span_log:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(span_log)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop exporters (on SIGTERM, before exit)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=5000)
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(carrier: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Write the current trace context (traceparent) into a dict of headers."""
    carrier = {} if carrier is None else carrier
    propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> context.Context:
    """The trace context carried by headers (an empty context when there is none)."""
    return propagate.extract(dict(carrier or {}))


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """Outgoing gRPC metadata carrying the current trace context."""
    return tuple(inject().items())


def current_ids() -> tuple[str, str]:
    """(trace_id, span_id) of the current span as hex, or empty strings."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
