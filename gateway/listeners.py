"""The listener table of a local stack (`looprl status --listeners`, docs/listeners.md): every TCP
port a process of the stack listens on, on which interface, what it serves and what guards it.

The processes are the stack's sessions (`up` starts nats-server, the Ray head and every service each
in a session of its own; Ray's workers, the replicas and trainer ranks among them, stay in the head's),
the sockets are read from /proc (services/kit/process/listeners.py), and each is named from what the stack
knows: its ports in stack.json, the Ray head's fixed ports, the replicas' addresses the router
reports. A socket none of these explains is listed as "unknown" (tests/e2e/test_stack_doors.py
fails on one, and checks the table against `ss -ltnp`).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from gateway.stack import PUBLIC_SERVICES, StackState
from services.kit.config import registry
from services.kit.local.infra import RayHead, session_pids
from services.kit.process.listeners import Listener, listeners

RAY_GUARD = "Ray token (RAY_AUTH_MODE=token: Ray checks it on its RPC and HTTP entry points)"
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range (drivers' ports among them)


def stack_processes(state: StackState) -> dict[int, str]:
    """Every process of the stack, by pid, with the part it belongs to: nats-server, ray-head (Ray's
    own processes and its workers: replicas, trainer ranks, sandbox workers) or a service (its process
    and whatever it started)."""
    parts = {pid: "nats-server" for pid in session_pids(state.nats_pid)}
    parts |= {pid: "ray-head" for pid in session_pids(state.ray_pid)}
    for svc in state.services:
        parts |= {pid: svc.name for pid in session_pids(svc.pid)}
    return parts


def _replica_ports(state: StackState) -> dict[int, str]:
    """What each inference replica's ports serve, by port (asked of the router)."""
    from looprl.inference.v1 import inference_pb2, inference_pb2_grpc

    out: dict[int, str] = {}
    try:
        with state.channel("inference-router") as channel:
            reply = inference_pb2_grpc.InferenceRouterServiceStub(channel).ListDeployments(
                inference_pb2.ListDeploymentsRequest(), timeout=5
            )
    except grpc.RpcError:
        return out
    for deployment in reply.deployments:
        for replica in deployment.replicas:
            if replica.address:
                out[int(replica.address.rpartition(":")[2])] = f"replica {replica.name} gRPC"
            if replica.metrics_address:
                out[int(replica.metrics_address.rpartition(":")[2])] = f"replica {replica.name} metrics"
    return out


def _classify(state: StackState, part: str, listener: Listener, replicas: dict[int, str]) -> tuple[str, str]:
    """(what listens, what guards it) for one listening socket of the stack."""
    port, mtls = (
        listener.port,
        "mutual TLS (the stack's CA) + the authorization table (services/kit/rpc/authz.py)",
    )
    metrics = "none: read-only metrics, no secrets; reachable where it is bound"
    if part == "nats-server" and port == state.nats_port:
        return (
            "NATS client port (JetStream)",
            "a NATS user and password per service (services/kit/bus/nats_auth.py)",
        )
    if part in registry.NAMES:
        svc, spec = state.service(part), registry.service(part)
        if port == svc.grpc_port:
            if part in PUBLIC_SERVICES:
                return f"gRPC {spec.grpc_service}", "bearer token (gateway tokens and tenants)"
            return f"gRPC {spec.grpc_service}", mtls
        if port == svc.metrics_port:
            return "Prometheus /metrics" + (" and /targets" if part == "inference-router" else ""), metrics
        if part == "gateway" and port == state.http_port:
            return "HTTP API (/v1/runs) and OpenAI endpoints", "bearer token (gateway tokens and tenants)"
        if spec.ray_driver and port in RAY_WORKER_PORTS:
            return "Ray driver (its core worker)", RAY_GUARD
        return "unknown", "unknown"
    if part != "ray-head":
        return "unknown", "unknown"
    if port in replicas:
        kind = replicas[port]
        if kind.endswith("gRPC"):
            return f"{kind} (InferenceEngineService, health, reflection)", mtls
        return f"{kind} (Prometheus /metrics)", metrics
    head = {p: option for option, p in RayHead(Path(state.state_dir), state.ray_port).ports().items()}
    if port in head:
        return ("Ray GCS" if port == state.ray_port else f"Ray head's {head[port]}"), RAY_GUARD
    if port in RAY_WORKER_PORTS:
        return "Ray worker (its core worker)", RAY_GUARD
    if listener.process.startswith("ray::TrainerWor"):
        return (
            "trainer rank's torch.distributed rendezvous (TCPStore) or gloo transport",
            "none: torch.distributed has no authentication (trusted network only)",
        )
    return "unknown", "unknown"


def listener_rows(state: StackState) -> list[dict[str, str]]:
    """Every TCP port a process of the stack listens on: where (interface), by whom, what it serves
    and what guards it."""
    parts = stack_processes(state)
    replicas = _replica_ports(state)
    rows = []
    for listener in listeners(parts):
        what, guard = _classify(state, parts[listener.pid], listener, replicas)
        rows.append(
            {
                "port": str(listener.port),
                "address": listener.address,
                "interface": listener.interface,
                "part": parts[listener.pid],
                "process": f"{listener.process} ({listener.pid})",
                "what": what,
                "guard": guard,
            }
        )
    return rows
