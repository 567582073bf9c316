"""OpenTelemetry tracing for every service: provider setup, exporters and context propagation.

Spans go to an OTLP collector when an endpoint is configured (Tempo behind it, seen in
Grafana), and optionally to a JSON-lines file, which is how tests follow one trace across
processes. Context travels as W3C traceparent in gRPC metadata, NATS headers and the arguments of
Ray actor calls (`inject` / `extract`); Ray actors that make spans set tracing up from the
settings their service hands them (`exporter_settings`, `setup_from_settings`).

Trace shape: each episode task is its own trace (a root span linked to its run's trace), holding
the agent loop, every Generate and reward call, the rollout publish and the packer's consume;
steps (packer, trainer) and weight deliveries are their own traces, linked to what they contain
or deliver. So no trace grows with the length of a run. `ATTR` names the span attributes every
service uses; `MAX_LINKS` caps the links one span carries.
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
from opentelemetry.trace import Link, SpanContext


class ATTR:
    """Span attribute names shared by every service (one place, so queries in Tempo match)."""

    RUN_ID = "looprl.run_id"
    ROLLOUT_ID = "looprl.rollout_id"
    TASK_ID = "looprl.task_id"
    STEP = "looprl.step"
    WEIGHT_VERSION = "looprl.weight_version"
    TOKENS = "looprl.tokens"
    STALENESS = "looprl.staleness"
    DEPLOYMENT = "looprl.deployment"
    REPLICA = "looprl.replica"
    ROLLOUTS = "looprl.rollouts"
    LINKS_DROPPED = "looprl.links_dropped"


# Links one span carries at most (a step's rollouts: the default recipe has 64 per step); beyond
# it the span records how many were left out (ATTR.LINKS_DROPPED).
MAX_LINKS = 512

_provider: TracerProvider | None = None
_settings: dict[str, str] = {}


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (for tests and offline debugging)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            if ctx is None:
                continue
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
                        "links": [
                            {
                                "trace_id": format(link.context.trace_id, "032x"),
                                "span_id": format(link.context.span_id, "016x"),
                            }
                            for link in span.links
                        ],
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
    global _provider, _settings
    if _provider is not None:
        return _provider
    _settings = {"otlp_endpoint": otlp_endpoint, "span_log": span_log}
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


def exporter_settings() -> dict[str, str]:
    """Where this process sends spans, for the Ray actors it starts (empty: tracing is off)."""
    return {k: v for k, v in _settings.items() if v}


def setup_from_settings(service_name: str, settings: Mapping[str, str] | None) -> None:
    """In a Ray actor: trace like the service that started it (nothing when it traces nowhere)."""
    if settings:
        setup_tracing(service_name, settings.get("otlp_endpoint", ""), settings.get("span_log", ""))


def flush() -> None:
    """Export finished spans now (a Ray actor may be killed without a shutdown)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=2000)


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


def error_status(exc: BaseException) -> trace.Status:
    """An ERROR status naming the exception (for span.set_status)."""
    return trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256])


def new_trace() -> context.Context:
    """A context with no span in it: a span started in it is the root of a new trace."""
    return context.Context()


def remote_span_context(carrier: Mapping[str, str] | None) -> SpanContext | None:
    """The span context carried by headers (traceparent), or None when they carry none."""
    ctx = trace.get_current_span(extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None


def current_carrier() -> dict[str, str]:
    """The current span as headers (for keeping it, e.g. to link to it later); {} when none."""
    return dict(inject()) if trace.get_current_span().get_span_context().is_valid else {}


def links(contexts: Sequence[SpanContext | None], limit: int = MAX_LINKS) -> tuple[list[Link], int]:
    """Links to the valid contexts, deduplicated and at most `limit`; also how many were left out."""
    seen: set[tuple[int, int]] = set()
    out: list[Link] = []
    dropped = 0
    for ctx in contexts:
        if ctx is None or not ctx.is_valid or (ctx.trace_id, ctx.span_id) in seen:
            continue
        seen.add((ctx.trace_id, ctx.span_id))
        if len(out) < limit:
            out.append(Link(ctx))
        else:
            dropped += 1
    return out, dropped


def link_carriers(
    carriers: Sequence[Mapping[str, str] | None], limit: int = MAX_LINKS
) -> tuple[list[Link], int]:
    """`links` over headers (traceparent) instead of span contexts. Headers with no value link to
    nothing and are not parsed (with tracing off, every rollout's traceparent is empty)."""
    return links([remote_span_context(c) for c in carriers if c and any(c.values())], limit)
