"""The TCP ports processes listen on, read from /proc (Linux): which process owns which listening
socket, on which address. `looprl up` waits for a port its own process listens on (not merely a
port something answers on), and `looprl status --listeners` lists every port of a stack."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp{,6}


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    """The process's name (/proc/<pid>/comm: "gcs_server", "raylet", "ray::ReplicaActor", "python")."""
    address: str
    """The bound address as bound: "0.0.0.0" or "::" for every interface, "::ffff:127.0.0.1" for an
    IPv4 address on a dual-stack socket."""
    port: int

    @property
    def interface(self) -> str:
        """Where it is reachable from: "all interfaces", "loopback", or the one address."""
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified:
            return "all interfaces"
        return "loopback" if ip.is_loopback else str(ip)


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel writes each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"  # as ss and the kernel's users write it
    return str(ip)


def listening_sockets(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """(address, port) of every listening TCP socket of `pid`'s network namespace, by socket inode."""
    out: dict[int, tuple[str, int]] = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != _LISTEN:
                continue
            address, port = fields[1].split(":")
            out[int(fields[9])] = (_address(address), int(port, 16))
    return out


def process_name(pid: int) -> str:
    """/proc/<pid>/comm: the kernel's name of the process (15 characters at most); "" when gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket the processes `pids` hold, ordered by port (a socket several of them
    share, inherited across a fork, is listed under each)."""
    tables: dict[str, dict[int, tuple[str, int]]] = {}  # by network namespace
    out = []
    for pid in pids:
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        if namespace not in tables:
            tables[namespace] = listening_sockets(pid)
        sockets = tables[namespace]
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and (inode := int(target[8:-1])) in sockets:
                address, port = sockets[inode]
                out.append(Listener(pid, process_name(pid), address, port))
    return sorted(set(out), key=lambda x: (x.port, x.pid))


def listens(pids: Iterable[int], port: int) -> bool:
    """Whether one of `pids` holds a listening socket on `port`."""
    return any(listener.port == port for listener in listeners(pids))
