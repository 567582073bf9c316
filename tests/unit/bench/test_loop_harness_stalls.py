"""A benchmark's run that stops progressing is stopped and fails with the run's own reason, rather
than holding the benchmark forever (bench/loop_harness.py), against a gateway answering over gRPC."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from bench.loop_harness import RunStalled, run_recipe
from looprl.gateway.v1 import gateway_pb2, gateway_pb2_grpc


class QuietGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """A run that trains 29 of 30 steps and then nothing more; optionally reads STALLED."""

    def __init__(self, stalled_reason: str = "") -> None:
        self.stalled_reason = stalled_reason
        self.stopped: list[str] = []

    def run(self) -> gateway_pb2.Run:
        run = gateway_pb2.Run(run_id="r", state=gateway_pb2.RUN_STATE_RUNNING, step=29, total_steps=30)
        run.episodes_published, run.rollouts_trained = 960, 928
        run.rollouts_dropped["stale"] = 8
        run.last_error.component, run.last_error.message = "trainer", "step 29 not complete in time"
        if self.stalled_reason:
            run.state, run.stalled_reason = gateway_pb2.RUN_STATE_STALLED, self.stalled_reason
        return run

    def CreateRun(self, request, context):
        return gateway_pb2.CreateRunResponse(run=self.run())

    def GetRun(self, request, context):
        return gateway_pb2.GetRunResponse(run=self.run())

    def StopRun(self, request, context):
        self.stopped.append(request.run_id)
        return gateway_pb2.StopRunResponse(run=self.run())

    def WatchRun(self, request, context):
        yield gateway_pb2.WatchRunResponse(run=self.run())
        while context.is_active():  # nothing changes, so nothing more is sent
            time.sleep(0.05)


@pytest.fixture
def gateway_of():
    servers = []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    yield start
    for server in servers:
        server.stop(0)


def test_a_run_that_stops_progressing_is_stopped_and_fails_the_bench_with_its_state(gateway_of) -> None:
    gateway = QuietGateway()
    started = time.monotonic()
    with pytest.raises(RunStalled) as stalled:
        run_recipe(gateway_of(gateway), (), "", "r", stall_s=1.5)
    assert time.monotonic() - started < 10
    message = str(stalled.value)
    assert message.startswith("run r stalled at step 29/30 (nothing progressed for ")
    assert "last error from trainer: step 29 not complete in time" in message
    assert "published 960, trained 928, dropped {'stale': 8}" in message
    assert gateway.stopped == ["r"]


def test_a_run_the_gateway_reads_stalled_fails_at_once_with_the_gateways_reason(gateway_of) -> None:
    gateway = QuietGateway("nothing trained, fed or published for 600s; rollout-packer not serving")
    started = time.monotonic()
    with pytest.raises(RunStalled, match="rollout-packer not serving"):
        run_recipe(gateway_of(gateway), (), "", "r", stall_s=600)
    assert time.monotonic() - started < 5
    assert gateway.stopped == ["r"]
