"""The metric table's helpers: only names in the table can be made, with the table's type; latency
observations inside a sampled span carry the trace id as an exemplar in the OpenMetrics exposition
Prometheus asks for."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from services.kit.rpc import interceptors
from services.kit.telemetry import metrics as metric_names
from services.kit.telemetry.metrics import observe


def test_a_name_outside_the_table_or_of_another_type_is_refused():
    with pytest.raises(KeyError, match=r"not in services/kit/telemetry/metrics\.py"):
        metric_names.counter("looprl_made_up_total")
    with pytest.raises(TypeError, match="is a histogram in the catalog"):
        metric_names.gauge("looprl_rpc_duration_seconds")


def test_latency_inside_a_sampled_span_carries_its_trace_id_as_exemplar():
    provider = TracerProvider()  # sampled by default; not installed globally
    with provider.get_tracer("test").start_as_current_span("rpc") as span:
        observe(interceptors.RPC_SECONDS.labels("exemplar-test", "/Traced"), 0.003)
        trace_id = format(span.get_span_context().trace_id, "032x")
    observe(interceptors.RPC_SECONDS.labels("exemplar-test", "/Untraced"), 0.003)
    lines = generate_openmetrics(REGISTRY).decode().splitlines()
    traced = [line for line in lines if 'method="/Traced"' in line and "_bucket" in line and " # " in line]
    assert traced and all(f'trace_id="{trace_id}"' in line for line in traced)
    untraced = [line for line in lines if 'method="/Untraced"' in line and " # " in line]
    assert untraced == []
    assert trace.get_current_span().get_span_context().is_valid is False
