"""free_port: ports another process can bind a few seconds later without losing them to a client."""

import socket
from pathlib import Path

from services.kit.local.infra import free_port


def test_free_ports_are_distinct_bindable_and_never_ones_outgoing_connections_take() -> None:
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < ephemeral_start
    for port in ports[:20]:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
            listener.listen()
