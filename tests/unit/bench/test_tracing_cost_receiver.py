"""The tracing-cost bench's local OTLP receiver counts what the services' real exporter sends it,
and the bench's "off" side configures no exporter at all."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bench.tracing_cost import OtlpReceiver, tracing_env


def test_the_receiver_counts_every_span_the_otlp_exporter_sends() -> None:
    receiver = OtlpReceiver().start()
    try:
        env = tracing_env(receiver)
        provider = TracerProvider(resource=Resource.create({"service.name": "bench-test"}))
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=env["LOOPRL_OTLP_ENDPOINT"], insecure=True))
        )
        tracer = provider.get_tracer("bench-test")
        for i in range(7):
            with tracer.start_as_current_span(f"span {i}"):
                pass
        assert provider.force_flush(timeout_millis=10_000)
        provider.shutdown()
        assert receiver.spans == 7 and receiver.exports >= 1
    finally:
        receiver.stop()


def test_tracing_off_sends_spans_nowhere() -> None:
    assert tracing_env(None) == {"LOOPRL_OTLP_ENDPOINT": "", "LOOPRL_SPAN_LOG": ""}
