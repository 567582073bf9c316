"""Several "hosts" on one machine, for multi-host tests: Linux network + mount namespaces.

Each test host is a network namespace with its own loopback and a veth (eth0) into a bridge on a
private /24, plus a mount namespace with a private /dev/shm and /tmp (tmpfs), so neither a port on
127.0.0.1 nor a shared-memory segment nor a temp file leaks from one host to another. What every
host must see as on the machine (the checkout, its virtual environment and Python: `shared_paths`)
stays visible where it lies under /tmp too: it is bind-mounted from the machine's /tmp into the
host's private one. The bridge lives in a namespace of its own; with `controller=True` the test
process gets an address on the subnet too (a veth from the root namespace), so it can call services
on any host.

A host's mount namespace is held by one `sleep` process; everything run on the host enters that
process's mount and network namespaces (`nsenter`), so all processes of one host share its /dev/shm,
as on a machine. `NamespaceHosts.close()` (the context manager's exit) stops every process started
on the hosts, then whatever else still lives in their network namespaces, deletes the namespaces
and the controller's interface, and `leftovers()` says what, if anything, survived.

Needs root, iproute2 (`ip netns`), `unshare`, `nsenter` and `mount`; `unavailable()` names what is
missing so tests can skip with that reason.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# Private /24s are drawn from here; one that the root namespace already routes is skipped.
_POOL = ipaddress.ip_network("10.200.0.0/13")
# The holder of a host's mount namespace. It keeps the machine's /tmp open as fd 3 before covering
# it with a private tmpfs, then bind-mounts each shared path ("$@", relative to /tmp) from that fd
# into the private /tmp; --no-canonicalize keeps mount(8) from resolving the fd's path back to
# the new, empty /tmp.
_HOLDER = """
exec 3</tmp
mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
for path in "$@"; do
    mkdir -p "/tmp/$path" && mount --no-canonicalize --rbind "/proc/$$/fd/3/$path" "/tmp/$path" || exit 1
done
exec 3<&-
echo ready
exec sleep 2147483647
"""
REPO_ROOT = Path(__file__).resolve().parents[2]


def default_shared_paths() -> tuple[str, ...]:
    """What every host sees as on the machine: the checkout, the virtual environment and the Python
    it was made from (only paths under /tmp need anything done)."""
    return (str(REPO_ROOT), sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)))


def under_tmp(paths: Sequence[str]) -> list[str]:
    """The paths among `paths` that lie under /tmp, relative to it, without those inside another."""
    tmp = Path("/tmp").resolve()
    found = []
    for path in paths:
        resolved = Path(path).resolve()
        if resolved == tmp:
            raise ValueError(f"{path} is /tmp itself: namespace hosts cannot have a private /tmp")
        if resolved.is_relative_to(tmp):
            found.append(resolved.relative_to(tmp))
    kept = [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]
    return sorted({str(p) for p in kept})


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "namespace hosts need root (network and mount namespaces); CI runs as root"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"namespace hosts need {', '.join(missing)} (iproute2, util-linux)"
    name = f"lrprobe-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        mount = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /dev/shm",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if mount.returncode != 0:
            return f"cannot mount a private /dev/shm in a mount namespace here: {mount.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def require() -> None:
    """Skip the calling test, with the reason, where namespace hosts cannot be made."""
    import pytest  # only tests call this; benches run without pytest installed

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class TestHost:
    """One namespace host: `address` is where the other hosts (and the controller) reach it."""

    index: int
    netns: str
    address: str
    holder: subprocess.Popen | None = None

    __test__ = False  # not a pytest test class

    @property
    def name(self) -> str:
        return f"host{self.index}"

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """`argv` as run on this host (its network and mount namespaces; in `cwd`, by default the
        caller's: entering a mount namespace would otherwise start it in /)."""
        assert self.holder is not None, "host is not started"
        where = cwd or os.getcwd()
        return ["nsenter", "-t", str(self.holder.pid), "--mount", "--net", f"--wd={where}", "--", *argv]


@dataclass
class NamespaceHosts:
    count: int
    controller: bool = True
    shared_paths: Sequence[str] = field(default_factory=default_shared_paths)
    tag: str = field(default_factory=lambda: f"lr{uuid.uuid4().hex[:6]}")
    hosts: list[TestHost] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None
    controller_address: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _pids: set[int] = field(default_factory=set)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def controller_link(self) -> str:
        return f"{self.tag}c"

    def __getitem__(self, index: int) -> TestHost:
        """hosts[1] is host 1 (1-based, as in "NATS on host 1")."""
        return self.hosts[index - 1]

    # ------------------------------------------------------------------ bring up
    def start(self) -> NamespaceHosts:
        assert 1 <= self.count <= 200
        self.subnet = self._free_subnet()
        addresses = list(self.subnet.hosts())
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.count + 1):
            host = TestHost(i, f"{self.tag}-h{i}", str(addresses[9 + i]))
            self.hosts.append(host)
            _ip("netns", "add", host.netns)
            self._plug(f"{self.tag}v{i}", f"{self.tag}p{i}", host.netns)
            _ip("-n", host.netns, "link", "set", f"{self.tag}v{i}", "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            # On-link default route: a service bound to 0.0.0.0 finds eth0 as its primary address
            # (services/kit/process/hosts.py), and nothing is forwarded anywhere.
            _ip("-n", host.netns, "route", "add", "default", "dev", "eth0")
        if self.controller:
            self.controller_address = str(addresses[0])
            self._plug(self.controller_link, f"{self.tag}cp", None)
            _ip(
                "addr",
                "add",
                f"{self.controller_address}/{self.subnet.prefixlen}",
                "dev",
                self.controller_link,
            )
            _ip("link", "set", self.controller_link, "up")
        shared = under_tmp(self.shared_paths)
        for host in self.hosts:
            host.holder = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.netns,
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    _HOLDER,
                    "holder",
                    *shared,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self._pids.add(host.holder.pid)
            line = host.holder.stdout.readline() if host.holder.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"{host.name}: mount namespace failed: {host.holder.stderr.read()}")
        return self

    def _plug(self, outer: str, inner: str, netns: str | None) -> None:
        """A veth pair: `inner` into the bridge, `outer` into `netns` (None: stays in the root one)."""
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", inner, "master", "br0")
        _ip("-n", self.switch, "link", "set", inner, "up")
        if netns is not None:
            _ip("link", "set", outer, "netns", netns)

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = []
        for word in _ip("-4", "route", "show", "table", "all").stdout.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass  # not an address: a keyword, a device name
        candidates = list(_POOL.subnets(new_prefix=24))
        random.shuffle(candidates)
        for net in candidates:
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError(f"no free /24 in {_POOL} for namespace hosts")

    # ------------------------------------------------------------------ processes
    def popen(self, host: int | TestHost, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on a host (its own session, so close() can stop its whole group)."""
        target = host if isinstance(host, TestHost) else self[host]
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(target.command(argv, kwargs.pop("cwd", None)), **kwargs)
        self._procs.append(proc)
        self._pids.add(proc.pid)
        return proc

    def run(
        self, host: int | TestHost, argv: Sequence[str], timeout: float = 60.0, cwd: str | None = None
    ) -> str:
        """Run `argv` on a host to completion (in `cwd`, by default the caller's); its stdout
        (raises with its stderr on failure)."""
        target = host if isinstance(host, TestHost) else self[host]
        done = subprocess.run(target.command(argv, cwd), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{target.name}: {list(argv)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def kill_host(self, host: int) -> None:
        """Lose a host as a machine is lost: its link to the bridge goes down (peers see silence,
        not a closed connection), then every process in it is SIGKILLed (the holder of its mount
        namespace too: its /dev/shm and /tmp go with it)."""
        _ip("-n", self.switch, "link", "set", f"{self.tag}p{host}", "down")
        for pid in self._netns_pids(self[host].netns):
            self._pids.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ tear down
    def close(self, grace: float = 5.0) -> None:
        for proc in self._procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
        for host in self.hosts:
            # Anything else still in the host's network namespace was started there by this harness
            # (a child that left its process group, the mount-namespace holder).
            for pid in self._netns_pids(host.netns):
                self._pids.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in [*self._procs, *(h.holder for h in self.hosts if h.holder is not None)]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for host in self.hosts:
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.controller_link, check=False)
        _ip("netns", "del", self.switch, check=False)

    @staticmethod
    def _netns_pids(netns: str) -> list[int]:
        out = _ip("netns", "pids", netns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def leftovers(self) -> dict[str, list[str]]:
        """Namespaces, root-namespace interfaces and processes of this harness that still exist."""
        namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
        links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link").stdout.splitlines()]
        # A SIGKILLed process that is not our child exits a moment later (and is reaped by its own
        # parent): give stragglers a few seconds before calling them left over.
        deadline = time.monotonic() + 5.0
        while True:
            alive = []
            for pid in sorted(self._pids):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().split(")")[-1].split()[0] != "Z":
                            alive.append(str(pid))
                except FileNotFoundError:
                    pass
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return {
            "namespaces": [n for n in namespaces if n.startswith(self.tag)],
            "interfaces": [link for link in links if link.startswith(self.tag)],
            "processes": alive,
        }


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@contextmanager
def namespace_hosts(
    count: int, *, controller: bool = True, shared_paths: Sequence[str] | None = None
) -> Iterator[NamespaceHosts]:
    """`count` namespace hosts (hosts[1] .. hosts[count]); everything is torn down on exit.
    `shared_paths` replace the default ones (default_shared_paths) the hosts see as on the machine."""
    hosts = NamespaceHosts(
        count, controller, shared_paths if shared_paths is not None else default_shared_paths()
    )
    try:
        yield hosts.start()
    finally:
        hosts.close()
