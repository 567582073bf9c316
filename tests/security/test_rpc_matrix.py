"""The attack suite's gRPC half: every RPC of every service, generated from the proto descriptors,
called on a stack `looprl up` started. Without a valid certificate no call is served; with another
service's identity every call is PERMISSION_DENIED. A new RPC or service is covered automatically
(and refused until services/kit/rpc/authz.py names who may call it)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import looprl
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.rpc import authz, tls

# Served to users with bearer tokens, not certificates (gateway/auth.py and its own tests).
PUBLIC = {"looprl.gateway.v1.GatewayService"}


def proto_services() -> list[ServiceDescriptor]:
    """Every gRPC service declared under protos/ (the generated looprl.*_pb2 modules)."""
    found = []
    for info in pkgutil.walk_packages(looprl.__path__, "looprl."):
        if info.name.endswith("_pb2"):
            found.extend(importlib.import_module(info.name).DESCRIPTOR.services_by_name.values())
    return sorted(found, key=lambda s: s.full_name)


def rpcs() -> Iterator[tuple[str, MethodDescriptor]]:
    for service in proto_services():
        if service.full_name not in PUBLIC:
            for method in service.methods:
                yield f"/{service.full_name}/{method.name}", method


def test_every_rpc_in_the_protos_has_declared_callers() -> None:
    paths = [path for path, _ in rpcs()]
    assert len(paths) >= 30
    missing = [path for path in paths if not authz.allowed_callers(path)]
    assert not missing, f"RPCs no identity may call (add them to services/kit/rpc/authz.py): {missing}"
    stale = [
        f"/{service}/{method}"
        for service, methods in authz.POLICY.items()
        for method in methods
        if f"/{service}/{method}" not in paths
    ]
    assert not stale, f"authz.py names RPCs the protos do not declare: {stale}"
    for callers in authz.POLICY.values():
        assert all(identity in tls.IDENTITIES for identities in callers.values() for identity in identities)


def call(channel: grpc.Channel, path: str, method: MethodDescriptor) -> None:
    """One call with an empty request (authorization is checked before the request is read)."""
    if method.client_streaming:
        stub = channel.stream_stream(path) if method.server_streaming else channel.stream_unary(path)
        request = iter([b""])
    else:
        stub = channel.unary_stream(path) if method.server_streaming else channel.unary_unary(path)
        request = b""
    reply = stub(request, timeout=10)
    if method.server_streaming:
        list(reply)


def refusal(channel: grpc.Channel, path: str, method: MethodDescriptor) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(channel, path, method)
    return info.value


def served_services(address: str, creds: tls.Credentials) -> list[str]:
    with tls.sync_channel(address, creds=creds) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    return [s.name for s in reply.list_services_response.service if s.name.startswith("looprl.")]


def endpoints(stack) -> dict[str, list[str]]:
    """gRPC service name -> addresses serving it in the stack: each service process, and the engine
    replicas the router lists."""
    operator = stack.state.credentials()
    found: dict[str, list[str]] = {}
    for svc in stack.state.services:
        if svc.name == "gateway":
            continue
        for name in served_services(svc.address, operator):
            found.setdefault(name, []).append(svc.address)
    with stack.state.channel("inference-router") as channel:
        reply = inference_pb2_grpc.InferenceRouterServiceStub(channel).ListDeployments(
            inference_pb2.ListDeploymentsRequest(), timeout=10
        )
    replicas = [r.address for d in reply.deployments for r in d.replicas if r.address]
    if replicas:
        found.setdefault("looprl.inference.v1.InferenceEngineService", []).append(replicas[0])
    return found


@pytest.mark.slow
def test_no_rpc_is_served_without_a_valid_certificate_or_to_the_wrong_identity(stack, tmp_path) -> None:
    served = endpoints(stack)
    declared = {path.split("/")[1] for path, _ in rpcs()}
    assert set(served) == declared, (
        f"services in the protos the stack does not serve: {declared - set(served)}"
    )
    ca = (stack.state.tls_dir / "ca.crt").read_bytes()
    rogue = tls.generate_dev_pki(tmp_path / "rogue", ["trainer"])
    # A certificate naming an allowed identity, signed by another CA.
    forged = tls.Credentials(
        "trainer", ca, (rogue / "trainer.crt").read_bytes(), (rogue / "trainer.key").read_bytes()
    )
    identities = {name: stack.state.credentials(name) for name in tls.IDENTITIES}
    checked = 0
    for path, method in rpcs():
        service = path.split("/")[1]
        allowed = authz.allowed_callers(path)
        for address in served[service]:
            unauthenticated = {
                "plaintext": grpc.insecure_channel(address),
                "no certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)),
                "another CA": tls.sync_channel(address, creds=forged),
            }
            for what, channel in unauthenticated.items():
                with channel:
                    error = refusal(channel, path, method)
                # The handshake refuses the connection, so the call never reaches the service.
                assert error.code() == grpc.StatusCode.UNAVAILABLE, f"{path} {what}: {error.code()}"
            for identity, creds in identities.items():
                if identity in allowed:
                    continue
                with tls.sync_channel(address, creds=creds) as channel:
                    error = refusal(channel, path, method)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (
                    f"{path} as {identity}: {error.code()} {error.details()}"
                )
                checked += 1
    assert checked >= 150
