"""Processes on namespace hosts (bench/harness/netns_hosts.py) for multi-host tests and benches:
waiting until one listens or serves, a weight-only engine (bench/harness/engine_process.py)
started on a chosen host, and a whole `looprl up` stack on host 1 with Ray workers joined from the
other hosts (`stack_on_hosts`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.stack import StackState
from looprl.gateway.v1 import gateway_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.local.infra import _bin
from services.modeling.config import ModelConfig

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


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
    argv = [PY, "-m", "bench.harness.engine_process", "--host", hosts[host].address]
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


# ---------------------------------------------------------------- a whole stack across hosts


@dataclass
class HostStack:
    """A `looprl up` stack on host 1 of `hosts` with Ray worker nodes joined from the other hosts;
    the test process (the controller) calls it over the bridge."""

    hosts: Any
    state: StackState
    state_dir: Path
    workers: dict[int, subprocess.Popen]
    stub: gateway_pb2_grpc.GatewayServiceStub
    metadata: tuple[tuple[str, str], ...]

    def log(self, name: str) -> str:
        return (self.state_dir / "logs" / f"{name}.log").read_text(errors="replace")


def _host_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # The session's in-process settings (a shm dir, a Ray address, gloo on "lo") belong to the
    # controller, not to processes on namespace hosts.
    drop = ("LOOPRL_SHM_DIR", "RAY_ADDRESS", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return {**env, **(extra or {})}


def ray_worker(hosts, host: int, head: str, token: str, cpus: float, resources: dict[str, float]):
    """A Ray worker node on `host` joined to `head` (`ray start --address`), offering `resources`."""
    env = _host_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"})
    return hosts.popen(
        host,
        [
            _bin("ray"),
            "start",
            "--block",
            f"--address={head}",
            f"--node-ip-address={hosts[host].address}",
            f"--num-cpus={cpus:g}",
            f"--resources={json.dumps(resources)}",
            "--disable-usage-stats",
            "--temp-dir=/tmp/ray",  # the host's own /tmp
            # The host's /dev/shm is a 1 GiB tmpfs; Ray's default store would not fit in it.
            "--object-store-memory=100000000",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextmanager
def stack_on_hosts(
    hosts,
    state_dir: Path,
    recipe_text: str,
    resources: dict[int, dict[str, float]],
    worker_cpus: float = 2,
    extra_env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Iterator[HostStack]:
    """`looprl up --host <host 1>` on host 1 (the same state dir, certificates, NATS users and Ray
    token as a local stack), with the router's deployments from `recipe_text`, and a Ray worker on
    every other host; `resources[i]` are host i's custom Ray resources. `state_dir` must be outside
    /tmp (each host has its own). `looprl down` on exit; the hosts' teardown stops the workers."""
    h1 = hosts[1].address
    state_dir.mkdir(parents=True, exist_ok=True)
    recipe = state_dir / "recipe.toml"
    recipe.write_text(recipe_text)
    cli = [PY, "-m", "gateway.cli", "--state-dir", str(state_dir)]
    up_log = state_dir / "up.log"
    with open(up_log, "wb") as out:
        up = hosts.popen(
            1,
            [
                *cli,
                "up",
                "--recipe",
                str(recipe),
                "--host",
                h1,
                "--ray-resources",
                json.dumps(resources[1]),
                *(f"--cert-host={h.address}" for h in hosts.hosts[1:]),
            ],
            env=_host_env(extra_env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
    try:
        # The router places its replicas while `up` waits for it: the workers join meanwhile.
        deadline = time.monotonic() + timeout
        state = None
        while state is None or not state.ray_token:
            assert up.poll() is None, f"looprl up exited {up.returncode}:\n{up_log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the Ray head never started"
            time.sleep(0.2)
            try:
                state = StackState.load(state_dir)
            except (ValueError, TypeError):
                state = None  # written while we read it
        wait_listening(h1, state.ray_port, up, "ray head")
        workers = {
            i: ray_worker(
                hosts, i, f"{state.host}:{state.ray_port}", state.ray_token, worker_cpus, resources[i]
            )
            for i in range(2, len(hosts.hosts) + 1)
        }
        try:
            up.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"looprl up not done after {timeout}s:\n{up_log.read_text()[-4000:]}"
            ) from None
        assert up.returncode == 0, f"looprl up exited {up.returncode}:\n{up_log.read_text()[-4000:]}"
        state = StackState.load(state_dir)
        channel = grpc.insecure_channel(
            state.service("gateway").address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        try:
            yield HostStack(
                hosts,
                state,
                state_dir,
                workers,
                gateway_pb2_grpc.GatewayServiceStub(channel),
                (("authorization", f"Bearer {state.gateway_token}"),),
            )
        finally:
            channel.close()
    finally:
        if up.poll() is None:
            up.kill()
        try:
            hosts.run(1, [*cli, "down"], timeout=120)
        except Exception as exc:  # host teardown still stops whatever is left
            print(f"looprl down on host 1 failed: {exc}")
