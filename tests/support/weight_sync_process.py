"""A real weight-sync service process: on a free port without the bus (for tests that register
targets and push versions by hand), or with the caller's env for tests that kill and restart it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from looprl.weightsync.v1 import weightsync_pb2
from services.kit.local.infra import free_port, stop_process_group, wait_for_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def weight_sync_process(log_dir: Path, port: int = 0, **settings: str) -> Iterator[tuple[str, str]]:
    """(address, log path) of a running weight-sync, on `port` (default: a free one); settings are
    LOOPRL_WEIGHTSYNC_<NAME> values."""
    port = port or free_port()
    env = {
        **os.environ,
        "LOOPRL_WEIGHTSYNC_GRPC_PORT": str(port),
        "LOOPRL_WEIGHTSYNC_USE_BUS": "false",
        "LOOPRL_WEIGHTSYNC_GRACE_SECONDS": "2",
        **{f"LOOPRL_WEIGHTSYNC_{name.upper()}": value for name, value in settings.items()},
    }
    log_path = log_dir / "weight-sync.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.weight_sync"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port(port, 90, proc, "weight-sync")
            yield f"127.0.0.1:{port}", str(log_path)
        finally:
            stop_process_group(proc, grace=10)


def start_weight_sync(env: dict[str, str]) -> subprocess.Popen:
    """A weight-sync process with exactly `env` (its bus, KV and ports), for tests that kill and restart it."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.weight_sync"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_weight_sync(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def wait_ready(stub: Any, proc: subprocess.Popen, run_id: str = "", timeout: float = 30.0) -> Any:
    """The GetVersion answer once the process serves; for `run_id` only, since weight-sync restores
    every run's targets from KV, other tests' runs included."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "weight-sync exited"
        try:
            return await stub.GetVersion(weightsync_pb2.GetVersionRequest(run_id=run_id), timeout=1)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2)
    raise AssertionError("weight-sync did not become ready")


async def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
