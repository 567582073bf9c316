"""Listening sockets read from /proc: this process's own listener is found with its address and port,
and an address says which interfaces reach it."""

from __future__ import annotations

import os
import socket

from services.kit.process.listeners import Listener, listeners


def test_a_listening_socket_of_this_process_is_found_with_its_address() -> None:
    with socket.socket() as four, socket.socket(socket.AF_INET6) as six:
        four.bind(("127.0.0.1", 0))
        four.listen()
        six.bind(("::", 0))
        six.listen()
        found = {(x.address, x.port) for x in listeners([os.getpid()])}
        assert ("127.0.0.1", four.getsockname()[1]) in found
        assert ("::", six.getsockname()[1]) in found


def test_an_address_names_the_interfaces_that_reach_it() -> None:
    assert Listener(1, "x", "::ffff:127.0.0.1", 1).interface == "loopback"
    assert Listener(1, "x", "127.0.0.1", 1).interface == "loopback"
    assert Listener(1, "x", "0.0.0.0", 1).interface == "all interfaces"
    assert Listener(1, "x", "::", 1).interface == "all interfaces"
    assert Listener(1, "x", "192.0.2.2", 1).interface == "192.0.2.2"
