"""`looprl run --local` owns the stack it brings up: stopped the way schedulers and closed terminals
stop a program (SIGTERM; SIGHUP takes the same path), it brings that stack down before it exits. The
state a killed stack left behind (its processes gone) does not pass for a running stack."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.stack import StackState
from tests.support.stack import ROOT, assert_stack_gone, free_port_args, looprl_cli

pytestmark = pytest.mark.slow


def _stale_state(state_dir: Path) -> None:
    """stack.json of a stack whose processes are gone (SIGKILLed, a reboot)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    StackState(str(state_dir), 4222, gone.pid, 26379, gone.pid, "ray-token", "gateway-token", 8080).save()


def test_a_local_run_stopped_by_sigterm_brings_its_stack_down(tmp_path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    _stale_state(state_dir)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "--state-dir",
            str(state_dir),
            "run",
            "configs/digits_grpo.toml",
            "--local",
            "--report-dir",
            str(tmp_path / "reports"),
            *free_port_args(),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in proc.stdout:  # the run is under way once a step has been trained
            seen.append(line)
            if re.search(r"step +[1-9]\d*/", line):
                break
        else:
            pytest.fail("the run never reported a step:\n" + "".join(seen[-30:]))
        state = StackState.load(state_dir.resolve())
        assert state is not None and state.services
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
        assert proc.returncode == 128 + signal.SIGTERM, "".join(seen[-10:]) + rest
        assert "bringing the local stack down" in rest
        assert StackState.load(state_dir.resolve()) is None, "the stack's state still says it is up"
        assert_stack_gone(state)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if StackState.load(state_dir.resolve()) is not None:
            looprl_cli(state_dir, "down")
