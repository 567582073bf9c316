"""The running stack: `looprl status`, and every service rejecting garbage with INVALID_ARGUMENT
while it keeps serving."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import looprl.environment.v1.environment_pb2
import looprl.gateway.v1.gateway_pb2
import looprl.inference.v1.inference_pb2
import looprl.packer.v1.packer_pb2
import looprl.reward.v1.reward_pb2
import looprl.trainer.v1.trainer_pb2
import looprl.weightsync.v1.weightsync_pb2  # noqa: F401
from services.kit.rpc import authz, tls

pytestmark = pytest.mark.slow

GARBAGE = b"\xff\xff\xff\xff\x0f\x00garbage"


def test_status_shows_every_service_serving(stack) -> None:
    result = stack.looprl("status")
    assert result.returncode == 0, result.stdout + result.stderr
    for svc in stack.state.services:
        line = next(line for line in result.stdout.splitlines() if line.startswith(svc.name + " "))
        assert "SERVING" in line and str(svc.pid) in line and svc.address in line


def _looprl_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(
        iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    )
    return [s.name for s in reply.list_services_response.service if s.name.startswith("looprl.")]


def _allowed_channel(stack, svc, path: str) -> grpc.Channel:
    """A channel to svc as a caller allowed to call path (others are refused before it is read)."""
    if svc.name == "gateway":
        return stack.state.channel("gateway")
    identity = sorted(authz.allowed_callers(path))[0]
    return tls.sync_channel(svc.address, creds=stack.state.credentials(identity))


def test_every_service_answers_garbage_with_invalid_argument_and_keeps_serving(stack) -> None:
    pool = descriptor_pool.Default()
    checked = []
    for svc in stack.state.services:
        with stack.state.channel(svc.name) as operator:
            names = _looprl_services(operator)
            assert names, f"{svc.name} exposes no looprl service over reflection"
            for name in names:
                for method in pool.FindServiceByName(name).methods:
                    path = f"/{name}/{method.name}"
                    with _allowed_channel(stack, svc, path) as channel:
                        if method.client_streaming:
                            call = (
                                channel.stream_unary if not method.server_streaming else channel.stream_stream
                            )
                            request = iter([GARBAGE])
                        else:
                            call = (
                                channel.unary_unary if not method.server_streaming else channel.unary_stream
                            )
                            request = GARBAGE
                        with pytest.raises(grpc.RpcError) as err:
                            reply = call(path)(request, timeout=10)
                            if method.server_streaming:
                                list(reply)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                        f"{path}: {err.value.code()} {err.value.details()}"
                    )
                    assert "malformed" in err.value.details()
                    checked.append(path)
            health = health_pb2_grpc.HealthStub(operator).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, f"{svc.name} stopped serving"
    assert len(checked) >= 25
