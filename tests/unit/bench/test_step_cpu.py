"""bench/step_cpu.py tells the stack's processes apart by command line, and counts nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.step_cpu import cpu_ms_by_process, service_of


def test_each_stack_process_is_named_by_its_service() -> None:
    named = {
        "/venv/bin/python -m services.environment_sandbox": "environment_sandbox",
        "/venv/bin/python -m gateway": "gateway",
        "ray::ReplicaActor": "ReplicaActor",
        "ray::TrainerWorker.pull_and_train": "TrainerWorker",
        "/venv/bin/nats-server -js -a 127.0.0.1 -p 4222": "nats-server",
        "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node-ip-address=x": "ray",
    }
    for cmdline, service in named.items():
        assert service_of(cmdline) == service, cmdline
    for other in ("/venv/bin/python -m bench.step_cpu", "/venv/bin/python -m pytest", "bash", ""):
        assert service_of(other) is None, other


def test_a_busy_service_process_shows_its_cpu_time() -> None:
    # A process that looks like a service to the bench and spins for half a second.
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spin, "-m", "services.spinner"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            used = cpu_ms_by_process().get(child.pid)
            if used is not None and used[1] >= 450:
                break
            time.sleep(0.1)
        assert used is not None and used[0] == "spinner" and used[1] >= 450
        assert os.getpid() not in cpu_ms_by_process()  # the bench itself is not the stack
    finally:
        child.kill()
        child.wait()
