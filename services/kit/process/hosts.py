"""Host identity: which processes can share memory with each other.

Two processes are on the same "host" for weight delivery when they run on the same kernel (boot
id), in the same network namespace, and see the same shared-memory directory (the device and
inode of the /dev/shm mount, or of LOOPRL_SHM_DIR; a tmpfs mounted in another mount namespace
has another device, a bind mount of the same one does not). Two network namespaces, or two mount
namespaces with their own /dev/shm, on one kernel are therefore different hosts, as two machines
are. The identity is a claim a process
makes about itself; weight-sync still proves shared memory works with a probe segment
(services/weight_sync/placement.py) before it relies on it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from functools import lru_cache
from pathlib import Path


def shm_dir() -> Path:
    """Where this host's shared-memory segments live: /dev/shm where it exists (Linux), a temp dir
    otherwise (slower, still correct); LOOPRL_SHM_DIR overrides both."""
    override = os.environ.get("LOOPRL_SHM_DIR")
    if override:
        return Path(override)
    dev_shm = Path("/dev/shm")
    if dev_shm.is_dir() and os.access(dev_shm, os.W_OK):
        return dev_shm
    return Path(tempfile.gettempdir())


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")  # e.g. "net:[4026531840]"
    except OSError:
        return ""


def host_parts() -> dict[str, str]:
    """What the identity is made of, readable (logs, debugging a wrong transport choice)."""
    directory = shm_dir()
    try:
        st = os.stat(directory)
        shm = f"{directory}:{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = f"{directory}:missing"
    return {
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "net_ns": _namespace("net"),
        "shm": shm,
    }


@lru_cache(maxsize=1)
def host_identity() -> str:
    """A short stable digest of `host_parts()`; equal in every process of one host."""
    parts = host_parts()
    text = "\n".join(f"{k}={parts[k]}" for k in sorted(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def primary_address() -> str:
    """This host's address on the interface of its default route (what a service bound to 0.0.0.0
    advertises); the first non-loopback address of the host name without one; 127.0.0.1 last."""
    for probe in ("10.254.254.254", "192.0.2.1"):  # connect() on UDP sends nothing: it only routes
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                address = sock.getsockname()[0]
            if not address.startswith("127."):
                return address
        except OSError:
            continue
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not address.startswith("127."):
            return address
    return "127.0.0.1"


def interface_of(address: str) -> str:
    """The name of the local network interface that holds `address` ("" when none does): what
    gloo must bind (GLOO_SOCKET_IFNAME) for its peers on other hosts to reach it."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return ""


def node_address() -> str:
    """This process's address for peers on other hosts: its Ray node's where it runs in Ray (the
    address the node was started with), else the primary address."""
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    return primary_address()
