"""`wait_for_port` waits for the process it started to listen, not for anything to answer on the
port: a port held by another process, or a client socket connected to itself (possible in the
ephemeral range), must not pass for a started nats-server or Ray head. A process that dies first
fails with its own words."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from services.kit.local.infra import StartupFailed, free_port, wait_for_port


def test_a_port_another_process_listens_on_is_not_the_starting_process_listening() -> None:
    port = free_port()
    with socket.socket() as foreign:  # someone else's listener on the port
        foreign.bind(("127.0.0.1", port))
        foreign.listen()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(TimeoutError, match=f"did not listen on port {port}"):
                wait_for_port(port, 1.5, sleeper, "sleeper")
        finally:
            sleeper.kill()
            sleeper.wait()


def test_the_process_listening_itself_passes() -> None:
    port = free_port()
    code = (
        f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(30)"
    )
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for_port(port, 20, server, "server")
    finally:
        server.kill()
        server.wait()


def test_a_process_that_dies_while_starting_fails_with_the_end_of_its_log(tmp_path) -> None:
    log = tmp_path / "component.log"
    with log.open("w") as out:
        dying = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.exit('bind: address already in use (port 4222)')"],
            stderr=out,
        )
    started = time.monotonic()
    with pytest.raises(StartupFailed) as err:
        wait_for_port(free_port(), 30, dying, "component", log=log)
    assert time.monotonic() - started < 10
    assert "component did not start: it exited with code 1" in str(err.value)
    assert "bind: address already in use (port 4222)" in str(err.value)
