"""gateway/stack.py's unwind_on_terminate: SIGTERM and SIGHUP unwind through `finally` blocks (where a
command brings its stack down) and exit 128 + the signal; a second signal during the unwind does not
cut it short; the handlers before the block come back after it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.stack import ROOT

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from gateway.stack import unwind_on_terminate

    sig = signal.Signals[sys.argv[1]]
    before = signal.getsignal(sig)
    try:
        with unwind_on_terminate():
            print("ready", flush=True)
            try:
                os.kill(os.getpid(), sig)
                time.sleep(10)
                print("not interrupted", flush=True)
            finally:
                os.kill(os.getpid(), sig)  # a second signal while bringing things down
                time.sleep(0.2)
                print("brought down", flush=True)
    finally:
        print("restored" if signal.getsignal(sig) is before else "not restored", flush=True)
    """
)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_terminating_signal_unwinds_once_and_exits_with_its_status(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, name], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["ready", "brought", "down", "restored"], done.stderr
    assert done.returncode == 128 + signal.Signals[name]
