"""The kit's server bootstrap, exercised on a real service process over real gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.local.infra import free_port, wait_for_port
from services.kit.telemetry import tracing as telemetry

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def probe(tmp_path):
    """Start tests/support/probe_service.py; yields (address, metrics_port, proc, span_log)."""
    port, metrics = free_port(), free_port()
    span_log = tmp_path / "spans.jsonl"
    env = {
        **os.environ,
        "LOOPRL_PROBE_GRPC_PORT": str(port),
        "LOOPRL_PROBE_METRICS_PORT": str(metrics),
        "LOOPRL_PROBE_DELAY": "2",
        "LOOPRL_PROBE_GRACE_SECONDS": "10",
        "LOOPRL_PROBE_MAX_MESSAGE_BYTES": str(1024 * 1024),
        "LOOPRL_SPAN_LOG": str(span_log),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.probe_service"], cwd=ROOT, env=env, stderr=subprocess.PIPE
    )
    wait_for_port(port, 30, proc, "probe service")
    yield f"127.0.0.1:{port}", metrics, proc, span_log
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def wait_serving(channel: grpc.Channel, timeout: float = 20) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.05)
    raise AssertionError("service never reported SERVING")


def test_health_reflection_and_metrics(probe) -> None:
    address, metrics_port, _, _ = probe
    with grpc.insecure_channel(address) as channel:
        wait_serving(channel)
        named = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="looprl.trainer.v1.TrainerService")
        )
        assert named.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(
            iter(
                reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            )
        )
        names = {s.name for s in answer.list_services_response.service}
        assert "looprl.trainer.v1.TrainerService" in names and "grpc.health.v1.Health" in names
        trainer_pb2_grpc.TrainerServiceStub(channel).GetConfig(trainer_pb2.GetConfigRequest())
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert 'looprl_rpc_requests_total{code="OK",method="/looprl.trainer.v1.TrainerService/GetConfig"' in body


def test_garbage_and_oversized_requests_get_clear_status_and_server_keeps_serving(probe) -> None:
    address, _, _, _ = probe
    with grpc.insecure_channel(address) as channel:
        wait_serving(channel)
        raw = channel.unary_unary("/looprl.trainer.v1.TrainerService/GetConfig")
        with pytest.raises(grpc.RpcError) as garbage:
            raw(b"\xff\xff\xff\xff\x0f garbage")
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed GetConfig request" in garbage.value.details()
        with pytest.raises(grpc.RpcError) as huge:
            raw(b"\x0a" + b"\x00" * (2 * 1024 * 1024))
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = trainer_pb2_grpc.TrainerServiceStub(channel).GetConfig(trainer_pb2.GetConfigRequest())
        assert isinstance(reply.config_json, str)


def test_unexpected_error_is_internal_with_trace_id(probe) -> None:
    address, _, _, _ = probe
    with grpc.insecure_channel(address) as channel:
        wait_serving(channel)
        with pytest.raises(grpc.RpcError) as err:
            trainer_pb2_grpc.TrainerServiceStub(channel).Checkpoint(
                trainer_pb2.CheckpointRequest(), timeout=5
            )
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "trace_id=" in err.value.details() and "disk on fire" in err.value.details()


def test_trace_context_crosses_one_grpc_hop(probe) -> None:
    address, _, _, span_log = probe
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("client") as span, grpc.insecure_channel(address) as channel:
        wait_serving(channel)
        want = format(span.get_span_context().trace_id, "032x")
        reply = trainer_pb2_grpc.TrainerServiceStub(channel).GetConfig(
            trainer_pb2.GetConfigRequest(), metadata=telemetry.grpc_metadata()
        )
    assert reply.config_json == want
    spans = [json.loads(line) for line in span_log.read_text().splitlines()]
    server = [s for s in spans if s["name"].endswith("GetConfig")]
    assert server and server[-1]["trace_id"] == want and server[-1]["kind"] == "SERVER"
    assert trace.get_current_span().get_span_context().is_valid is False


def _client_spans(monkeypatch):
    """The kit's client interceptors recording into memory (the test process has no exporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.kit.rpc import interceptors

    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(interceptors, "_client_tracer", provider.get_tracer("test"))
    return provider.get_tracer("test"), exporter


def _server_span(span_log: Path, trace_id: str, method: str) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        spans = [json.loads(line) for line in span_log.read_text().splitlines()] if span_log.exists() else []
        found = [s for s in spans if s["trace_id"] == trace_id and s["name"].endswith(method)]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {method} server span in trace {trace_id}")


def test_blocking_and_asyncio_calls_get_client_spans_parenting_the_server_span(probe, monkeypatch) -> None:
    import asyncio

    from services.kit.rpc.interceptors import traced_channel
    from services.kit.rpc.server import open_channel

    address, _, _, span_log = probe
    tracer, exporter = _client_spans(monkeypatch)
    with grpc.insecure_channel(address) as plain:
        wait_serving(plain)
    with tracer.start_as_current_span("caller"), traced_channel(grpc.insecure_channel(address)) as channel:
        trainer_pb2_grpc.TrainerServiceStub(channel).GetConfig(trainer_pb2.GetConfigRequest())

    async def call_async() -> None:
        with tracer.start_as_current_span("caller"):
            async with open_channel(address) as channel:
                await trainer_pb2_grpc.TrainerServiceStub(channel).GetConfig(trainer_pb2.GetConfigRequest())

    asyncio.run(call_async())
    clients = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.CLIENT]
    callers = [s for s in exporter.get_finished_spans() if s.name == "caller"]
    assert len(clients) == 2 and len(callers) == 2
    for client, caller in zip(clients, callers, strict=True):
        assert client.name == "looprl.trainer.v1.TrainerService/GetConfig"
        assert client.parent.span_id == caller.context.span_id
        assert client.attributes["rpc.grpc.status_code"] == 0
        server = _server_span(span_log, format(client.context.trace_id, "032x"), "GetConfig")
        assert server["parent_span_id"] == format(client.context.span_id, "016x")


def test_failed_call_ends_its_client_span_with_the_status(probe, monkeypatch) -> None:
    from services.kit.rpc.interceptors import traced_channel

    address, _, _, _ = probe
    _, exporter = _client_spans(monkeypatch)
    with traced_channel(grpc.insecure_channel(address)) as channel:
        wait_serving(channel)
        with pytest.raises(grpc.RpcError):
            trainer_pb2_grpc.TrainerServiceStub(channel).Checkpoint(trainer_pb2.CheckpointRequest())
    [client] = [s for s in exporter.get_finished_spans() if s.name.endswith("/Checkpoint")]
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert client.status.status_code is trace.StatusCode.ERROR


def test_sigterm_goes_not_serving_while_in_flight_call_completes(probe) -> None:
    address, _, proc, _ = probe
    with grpc.insecure_channel(address) as channel:
        wait_serving(channel)
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        in_flight = stub.Status.future(trainer_pb2.StatusRequest(), timeout=15)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetConfig(trainer_pb2.GetConfigRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert in_flight.result().step == 7
    assert proc.wait(timeout=15) == 0
