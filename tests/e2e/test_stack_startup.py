"""`looprl up` notices its own dead parts: when a process it started dies while starting (the Ray
head's GCS that cannot bind its port, a service refusing its settings), `up` fails at once with that
part's own words, brings down what it had started, and prints no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.kit.local.infra import pid_alive
from tests.support.stack import ROOT, free_port_args

pytestmark = pytest.mark.slow


def up(state_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--state-dir", str(state_dir), "up", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def left_running(state_dir: Path, ray_port: int) -> list[int]:
    """Processes of the failed stack still running: its services and nats-server name its state
    directory (in their environment or arguments), Ray's processes their temp directory."""
    marks = (str(state_dir).encode(), f"looprl-ray-{ray_port}".encode())
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as a, open(f"/proc/{entry}/environ", "rb") as e:
                seen = a.read() + e.read()
        except OSError:
            continue
        if any(mark in seen for mark in marks) and pid_alive(int(entry)):
            out.append(int(entry))
    return out


def ray_port_of(args: list[str]) -> int:
    return int(args[args.index("--ray-port") + 1])


def test_a_ray_head_whose_gcs_cannot_bind_fails_up_with_the_gcs_error(tmp_path: Path) -> None:
    args = free_port_args()
    ray_port = ray_port_of(args)
    # Another process holds the GCS port on a loopback address of its own: `up`'s check on 127.0.0.1
    # passes, and Ray's GCS, which binds every interface, cannot bind it (as when a connection takes
    # the port between the check and the bind).
    with socket.socket() as holder:
        holder.bind(("127.0.0.2", ray_port))
        holder.listen()
        started = time.monotonic()
        result = up(tmp_path, *args)
        took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ray head did not start: its GCS (gcs_server) exited" in result.stderr, result.stderr
    assert "Failed to start the grpc server" in result.stderr and str(ray_port) in result.stderr
    assert "Traceback" not in result.stderr
    assert took < 35, f"`up` took {took:.0f}s to notice (Ray's own start waits ~40 s)"
    assert left_running(tmp_path, ray_port) == []
    assert not (tmp_path / "stack.json").exists()


def test_a_service_that_dies_while_starting_fails_up_with_its_own_error(tmp_path: Path) -> None:
    args = free_port_args()
    result = up(tmp_path, *args, env={"LOOPRL_REWARD_LOG_LEVEL": "LOUD"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "reward exited during start-up" in result.stderr
    assert "configuration error" in result.stderr and "LOOPRL_REWARD_LOG_LEVEL" in result.stderr
    assert "Traceback" not in result.stderr
    assert left_running(tmp_path, ray_port_of(args)) == []
