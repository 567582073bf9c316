"""Parts of a local stack that looprl does not start (`looprl up --use ROLE=HOST:PORT[@IDENTITY]`):
another implementation of one of its services (any name of services/kit/config/registry.py but the
gateway), or inference engines that serve the recipe's deployment (`inference-engine`).

`up` starts nothing for them. It hands a service's address to its callers (the same variable as for
looprl's own), authorizes its certificate identity as that service when it differs from the name
(`external_identities`), and before the stack reports ready checks each part: the TLS handshake
with the stack's CA presenting a certificate issued to IDENTITY (the service's own name by default;
any name for an engine unless given), health SERVING, and the contract version its reflection
serves (conformance/served.py: looprl's service of that name, every RPC with the same types). An
engine is then registered with the inference-router (RegisterDeployment, as the operator) as the
recipe's deployment, with the router starting no replicas of its own.
"""

from __future__ import annotations

import socket
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.kit.config import registry

ENGINE = "inference-engine"
ENGINE_SERVICE = "looprl.inference.v1.InferenceEngineService"
# Recipe lengths this large mean "unbounded"; the proto says 0.
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class ExternalPart:
    role: str
    """A registry service name, or "inference-engine"."""
    address: str
    identity: str = ""
    """The common name its certificate must carry ("" for an engine: any the CA issued)."""

    @property
    def grpc_service(self) -> str:
        return ENGINE_SERVICE if self.role == ENGINE else registry.service(self.role).grpc_service

    @property
    def label(self) -> str:
        return f"{self.role} (external)"


def roles() -> tuple[str, ...]:
    return (*(n for n in registry.NAMES if n != "gateway"), ENGINE)


def parse(spec: str) -> ExternalPart:
    """`ROLE=HOST:PORT[@IDENTITY]`; ValueError with a sentence otherwise."""
    role, sep, rest = spec.partition("=")
    if not sep or role not in roles():
        raise ValueError(
            f"--use {spec!r}: expected ROLE=HOST:PORT[@IDENTITY], ROLE one of {', '.join(roles())}"
        )
    address, _, identity = rest.partition("@")
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--use {spec!r}: {address!r} is not HOST:PORT")
    return ExternalPart(role, address, identity or ("" if role == ENGINE else role))


def parse_all(specs: list[str]) -> list[ExternalPart]:
    parts = [parse(s) for s in specs]
    services = [p.role for p in parts if p.role != ENGINE]
    if len(set(services)) != len(services):
        raise ValueError(f"--use names a service twice: {', '.join(sorted(services))}")
    return parts


def service_env(parts: list[ExternalPart], peer_variables: dict[str, str]) -> dict[str, str]:
    """What every service of the stack is given for the external parts: their addresses, and the
    service each foreign identity stands in for."""
    import json

    env = {peer_variables[p.role]: p.address for p in parts if p.role in peer_variables}
    stand_ins = {p.identity: p.role for p in parts if p.role != ENGINE and p.identity != p.role}
    if stand_ins:
        env["LOOPRL_EXTERNAL_IDENTITIES"] = json.dumps(stand_ins)
    return env


def router_env(parts: list[ExternalPart], recipe: str | None) -> dict[str, str]:
    """The router's settings when engines serve the recipe's deployment: it starts no replicas,
    neither the recipe's nor a run's, and serves the engines `up` registers."""
    if not any(p.role == ENGINE for p in parts):
        return {}
    if not recipe:
        raise ValueError("--use inference-engine=...: give --recipe, whose deployment the engines serve")
    return {registry.service("inference-router").env_var("watch_runs"): "false"}


# ---- checks ---------------------------------------------------------------------------------------


def certificate_name(address: str, creds: Any, timeout: float = 3.0) -> str:
    """The common name of the certificate the part at `address` presents to a client of the stack's
    CA (which verifies it); raises OSError/ssl.SSLError when the handshake fails."""
    from services.kit.rpc.tls import certificate_identity

    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cadata=creds.ca.decode())
    context.check_hostname = False  # the name that matters is the common name, checked below
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "c.pem", Path(tmp) / "k.pem"
        cert.write_bytes(creds.cert)
        key.write_bytes(creds.key)
        context.load_cert_chain(cert, key)
    name = host.strip("[]")
    with (
        socket.create_connection((name, int(port)), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=name) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    return certificate_identity(ssl.DER_cert_to_PEM_cert(der).encode())


def problems(part: ExternalPart, creds: Any, timeout: float = 3.0) -> list[str]:
    """Why `part` cannot stand in for its role now (empty: it can)."""
    import grpc

    from conformance.served import contract_problems
    from services.kit.rpc import tls

    if creds is not None:
        try:
            name = certificate_name(part.address, creds, timeout)
        except (OSError, ssl.SSLError) as exc:
            return [f"no TLS handshake with the stack's CA: {exc}"]
        if part.identity and name != part.identity:
            return [f"its certificate is issued to {name!r}, not {part.identity!r}"]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tls.sync_channel(part.address, creds=creds) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as exc:
            return [f"health check: {exc.code().name}"]
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return [f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"]
        return contract_problems(channel, part.grpc_service, timeout)


def wait_ready(parts: list[ExternalPart], creds: Any, timeout: float, log=print) -> None:
    """Until every part can stand in for its role; TimeoutError naming what is still wrong."""
    deadline = time.monotonic() + timeout
    pending = list(parts)
    while pending:
        found = {p: problems(p, creds) for p in pending}
        pending = [p for p, why in found.items() if why]
        if not pending:
            break
        if time.monotonic() > deadline:
            wrong = "; ".join(f"{p.role} at {p.address}: {', '.join(found[p])}" for p in pending)
            raise TimeoutError(f"external parts not ready after {timeout:.0f}s: {wrong}")
        time.sleep(0.5)
    for p in parts:
        log(
            f"{p.label:<22}{p.address} (serves {p.grpc_service}, certificate {p.identity or 'any of the CA'})"
        )


def register_engines(parts: list[ExternalPart], recipe_path: str, router: Any) -> str:
    """Register the engines as the replicas of the recipe's first deployment; returns its name."""
    from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
    from services.kit.config.recipe import load_recipe

    engines = [p for p in parts if p.role == ENGINE]
    spec = load_recipe(recipe_path).deployments[0]

    def bound(value: int) -> int:
        return 0 if value >= _UNBOUNDED else value

    info = inference_pb2.DeploymentInfo(
        name=spec.name,
        backend="external",
        tensor_parallel=1,
        max_model_len=spec.max_model_len,
        layout="hf",
        dtype=spec.serving_dtype,
        profile=inference_pb2.LengthProfile(
            min_prompt_tokens=spec.min_prompt_tokens,
            max_prompt_tokens=bound(spec.max_prompt_tokens),
            min_output_tokens=spec.min_output_tokens,
            max_output_tokens=bound(spec.max_output_tokens),
        ),
        replicas=[
            inference_pb2.ReplicaInfo(name=f"{spec.name}-external-{i}", address=p.address)
            for i, p in enumerate(engines)
        ],
    )
    stub = inference_pb2_grpc.InferenceRouterServiceStub(router)
    stub.RegisterDeployment(inference_pb2.RegisterDeploymentRequest(deployment=info), timeout=30)
    return spec.name


def status_rows(parts: list[ExternalPart], creds: Any) -> list[dict[str, str]]:
    rows = []
    for p in parts:
        why = problems(p, creds, timeout=1.0)
        rows.append(
            {
                "name": p.label,
                "health": "SERVING" if not why else f"DOWN ({why[0][:60]})",
                "address": p.address,
                "pid": "external",
            }
        )
    return rows
