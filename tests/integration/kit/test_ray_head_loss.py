"""A service process whose Ray head is lost restarts into the new cluster (services/kit/ray/head_loss.py):
in place (same pid, same command line) by default, or by exiting 75 for the container entrypoint,
which rejoins the node first. Two driver processes join a private head, the head is SIGKILLed and a
new one started on the same port."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from services.kit.local.infra import RayHead, free_port
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DRIVER = """
import os, sys, time
from services.kit.ray import head_loss as ray_head
from services.kit.ray.cluster import connect_ray
ray_head.restart_on_loss(dict(os.environ), exit_instead=sys.argv[1] == "exit")
connect_ray(os.environ["RAY_ADDRESS"], "head-loss-test")
print("JOINED", os.getpid(), ray_head._joined.cluster_id, flush=True)
time.sleep(600)
"""


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(line) for line in proc.stdout], daemon=True).start()
    return out


def next_joined(out: queue.Queue, timeout: float) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = out.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith("JOINED "):
            _, pid, cluster = line.split()
            return int(pid), cluster
    raise AssertionError(f"no JOINED line within {timeout}s")


def test_a_service_restarts_into_the_new_cluster_when_its_ray_head_is_lost(tmp_path):
    head = RayHead(state_dir=tmp_path / "ray", port=free_port_above_20000(), num_cpus=2).start()
    env = {**os.environ, **head.env(), "PYTHONPATH": str(REPO_ROOT)}
    drivers = {
        mode: subprocess.Popen(
            [sys.executable, "-c", DRIVER, mode], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
        )
        for mode in ("restart", "exit")
    }
    try:
        outs = {mode: lines_of(proc) for mode, proc in drivers.items()}
        first = {mode: next_joined(out, 60) for mode, out in outs.items()}
        head.stop(grace=0.5)
        lost_at = time.monotonic()
        time.sleep(3)  # both notice the loss and wait for a head
        assert drivers["exit"].poll() is None and drivers["restart"].poll() is None
        head = RayHead(state_dir=tmp_path / "ray", port=head.port, num_cpus=2, token=head.token).start()
        assert drivers["exit"].wait(timeout=30) == 75  # the entrypoint's cue to rejoin the node
        pid, cluster = next_joined(outs["restart"], 90)
        print(f"rejoined {time.monotonic() - lost_at:.1f}s after the head was killed")
        assert pid == first["restart"][0] == drivers["restart"].pid  # restarted in place
        assert cluster != first["restart"][1]  # into the new cluster
    finally:
        for proc in drivers.values():
            proc.kill()
            proc.wait()
        head.stop()


def free_port_above_20000() -> int:
    """Ray heads take 6379 or a port above 20000."""
    while (port := free_port()) <= 20000:
        pass
    return port
