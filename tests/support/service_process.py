"""A service started as its own process (`python -m <module>`) on free ports, waited for until its
health check says SERVING, and stopped (SIGTERM, then SIGKILL) when the block ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.stack import health_status
from services.kit.local.infra import free_port


@dataclass
class ServiceProcess:
    proc: subprocess.Popen
    address: str
    metrics_url: str


@contextmanager
def service_process(
    module: str,
    env: dict[str, str],
    timeout: float = 60.0,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> Iterator[ServiceProcess]:
    """`env` is added to this process's environment (LOOPRL_GRPC_PORT/METRICS_PORT are chosen here);
    `wrap` turns the command into the one actually run (e.g. under capsh)."""
    port, metrics_port = free_port(), free_port()
    full = {
        **os.environ,
        "LOOPRL_LOG_LEVEL": "WARNING",
        **env,
        "LOOPRL_GRPC_PORT": str(port),
        "LOOPRL_METRICS_PORT": str(metrics_port),
    }
    command = [sys.executable, "-m", module]
    proc = subprocess.Popen(wrap(command) if wrap else command, env=full)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while health_status(address) != "SERVING":
            assert proc.poll() is None, f"{module} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{module} did not become SERVING within {timeout:.0f}s"
            time.sleep(0.2)
        yield ServiceProcess(proc, address, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
