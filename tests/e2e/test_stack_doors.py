"""The doors of a live stack (`looprl up`): who holds which secret, read from /proc/<pid>/environ of
every process the stack runs; every port it listens on, in `looprl status --listeners` with its
interface and guard, checked against `ss -ltnp`; and the inference replica answering health and
reflection like every service, with its /metrics listed for Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.listeners import listener_rows, stack_processes
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.config import registry
from services.kit.rpc import tls

pytestmark = pytest.mark.slow


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


def test_only_the_gateway_holds_users_tokens_and_only_ray_and_its_drivers_the_ray_token(stack) -> None:
    state = stack.state
    drivers = {s.name for s in registry.SERVICES if s.ray_driver}
    processes = stack_processes(state)
    holders: dict[str, set[str]] = {"ray token": set(), "users' token": set()}
    for pid, part in processes.items():
        env = environ(pid)
        # By value: under whatever name a process may hold it.
        if state.ray_token.encode() in env:
            holders["ray token"].add(part)
        if state.gateway_token.encode() in env:
            holders["users' token"].add(part)
    assert holders["users' token"] == {"gateway"}
    assert holders["ray token"] == {"ray-head"} | drivers
    assert len(processes) > 2 * len(state.services), "the stack's processes were not all found"


def ss_listeners(pids: set[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP listener `ss -ltnp` shows for `pids`."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        local, users = fields[3], " ".join(fields[5:])
        address, _, port = local.rpartition(":")
        address = {"*": "::", "[::]": "::"}.get(address, address.strip("[]"))
        for pid in {int(p) for p in re.findall(r"pid=(\d+)", users)} & pids:
            found.add((pid, address, int(port)))
    return found


def test_the_listener_table_names_every_port_its_interface_and_guard_as_ss_sees_them(stack) -> None:
    state = stack.state

    def compared() -> tuple[list[dict], set, set]:
        rows = listener_rows(state)
        ours = {(int(r["process"].rsplit("(", 1)[1][:-1]), r["address"], int(r["port"])) for r in rows}
        theirs = ss_listeners(set(stack_processes(state)))
        # ss writes "*" for a socket of every interface whether it is 0.0.0.0 or ::.
        return rows, *(
            {(pid, "::" if a in ("0.0.0.0", "::") else a, port) for pid, a, port in x} for x in (ours, theirs)
        )

    for _ in range(3):  # Ray starts and ends idle workers now and then: a socket may come or go between reads
        rows, ours, theirs = compared()
        if ours == theirs:
            break
        time.sleep(1.0)
    assert ours == theirs
    unknown = [r for r in rows if r["guard"] == "unknown"]
    assert unknown == [], "ports the table cannot say what guards"
    served = {r["what"] for r in rows}
    expected = {"NATS client port (JetStream)", "Ray GCS", "HTTP API (/v1/runs) and OpenAI endpoints"}
    assert expected | {"Ray driver (its core worker)"} <= served, served
    assert any(r["what"].startswith("replica ") and "gRPC" in r["what"] for r in rows), served
    for svc in state.services:
        interfaces = {
            r["interface"] for r in rows if r["port"] in (str(svc.grpc_port), str(svc.metrics_port))
        }
        assert interfaces == {"loopback"}, (svc.name, interfaces)
    printed = stack.looprl("status", "--listeners")
    assert printed.returncode == 0, printed.stdout + printed.stderr
    for r in rows:
        assert any(
            line.startswith(r["port"] + " ") and r["guard"] in line for line in printed.stdout.splitlines()
        )


def test_the_inference_replica_answers_health_and_reflection_and_lists_its_metrics(stack) -> None:
    state = stack.state
    with state.channel("inference-router") as channel:
        reply = inference_pb2_grpc.InferenceRouterServiceStub(channel).ListDeployments(
            inference_pb2.ListDeploymentsRequest(), timeout=10
        )
    replica = reply.deployments[0].replicas[0]
    assert replica.address and replica.metrics_address, replica
    with tls.sync_channel(replica.address, creds=state.credentials()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        engine = "looprl.inference.v1.InferenceEngineService"
        for service in ("", engine):  # answering, as the contract says, weights or not
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == serving
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for s in next(iter(listing)).list_services_response.service}
        assert {engine, "grpc.health.v1.Health"} <= names
    # Still no way in without a certificate of the stack's CA.
    with pytest.raises(grpc.RpcError) as foreign, tls.sync_channel(replica.address) as plain:
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert foreign.value.code() == grpc.StatusCode.UNAVAILABLE
    metrics = urllib.request.urlopen(f"http://{replica.metrics_address}/metrics", timeout=10).read().decode()
    # This stack has served no run: its replica holds no weights yet, and says so.
    assert f'looprl_replica_ready{{deployment="short",replica="{replica.name}"}} 0.0' in metrics
    router = state.service("inference-router")
    targets = json.loads(
        urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/targets", timeout=10).read()
    )
    assert {
        "targets": [replica.metrics_address],
        "labels": {"deployment": "short", "replica": replica.name, "run": ""},
    } in targets
