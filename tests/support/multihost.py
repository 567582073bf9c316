"""Processes on namespace hosts (tests/support/netns_hosts.py) for multi-host tests and benches:
waiting until one listens or serves, and a weight-only engine (tests/support/engine_process.py)
started on a chosen host."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from looprl.weightsync.v1 import weightsync_pb2
from services.modeling.config import ModelConfig

PY = sys.executable


def wait_listening(address: str, port: int, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex((address, port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"{what} not listening on {address}:{port} after {timeout}s")


def wait_serving(address: str, port: int, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    """Until the service's gRPC health check says SERVING (it listens before it is ready)."""
    wait_listening(address, port, proc, what, timeout)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{what} exited with {proc.returncode}"
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"{what} not serving on {address}:{port} after {timeout}s")


def start_engine(hosts, host: int, config: ModelConfig | None = None) -> tuple[subprocess.Popen, str, str]:
    """A weight-only engine on `host` (of `config`, the tiny model by default): (process, address,
    host identity)."""
    argv = [PY, "-m", "tests.support.engine_process", "--host", hosts[host].address]
    if config is not None:
        argv += ["--config-json", json.dumps(config.to_dict())]
    proc = hosts.popen(
        host,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LOOPRL_SHM_DIR"},
    )
    for line in proc.stdout:
        if line.startswith("ADDRESS "):
            _, address, host_id = line.split()
            return proc, address, host_id
    raise AssertionError(f"engine on host {host} exited before listening (code {proc.wait()})")


async def wait_served(stub, version: int, deployments, timeout: float = 60.0):
    """Until weight-sync (`stub`) reports every one of `deployments` ready at `version`; the last
    GetVersion reply and its targets by deployment."""
    deadline = time.monotonic() + timeout
    while True:
        reply = await stub.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=10)
        targets = {t.deployment: t for t in reply.targets}
        if all(
            n in targets and targets[n].version == version and targets[n].state == "ready"
            for n in deployments
        ):
            return reply, targets
        if time.monotonic() > deadline:
            raise AssertionError(
                f"version {version} not served by {list(deployments)} after {timeout}s: {targets}"
            )
        await asyncio.sleep(0.05)
