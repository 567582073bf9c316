"""Local infrastructure processes: an embedded nats-server (JetStream) and a Ray head.

Both are started as child processes in their own process group, so stopping them never
touches another user's nats-server or Ray cluster on the same machine (no `ray stop`).
Used by `looprl up`, by `make run` and by the test suite's session fixtures.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.kit.process.listeners import listens, process_name

# Least privilege: the Ray cluster's address and token go only to Ray's own processes and the services
# that drive it (registry.ServiceSpec.ray_driver), users' tokens only to the gateway. Every other
# process the stack starts inherits the caller's environment without them.
RAY_VARIABLES = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "LOOPRL_RAY_ADDRESS")
USER_TOKEN_VARIABLES = ("LOOPRL_GATEWAY_TOKENS", "LOOPRL_GATEWAY_TENANTS", "LOOPRL_TOKEN")


def environ_without(names: tuple[str, ...]) -> dict[str, str]:
    """This process's environment less `names`: what a child that must not hold them starts with."""
    return {k: v for k, v in os.environ.items() if k not in names}


class StartupFailed(RuntimeError):
    """A process the stack started died (or never listened) while starting; the message holds its own
    words (the end of its log)."""


def log_excerpt(path: Path, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


class PortInUseError(RuntimeError):
    """A port we were asked to listen on is already taken; `port` says which."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# Below the kernel's ephemeral range (32768+ by default) and above the ranges the test suite gives
# whole stacks (21000-28000) and Ray its workers (10002-19999).
_FREE_PORTS_FROM = 28000
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux's default: 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port that is free right now, for another process to listen on soon. It lies below the
    kernel's ephemeral range where there is room: the kernel hands those ports to outgoing
    connections, so one chosen there can be taken by any connect() before its listener binds it.
    A process never gets the same port twice."""
    span = ephemeral_range()[0] - _FREE_PORTS_FROM
    for _ in range(200 if span >= 1000 else 0):
        port = _FREE_PORTS_FROM + secrets.randbelow(span)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_free(port: int, what: str, host: str = "127.0.0.1") -> None:
    if not port_is_free(port, host):
        raise PortInUseError(
            f"{what}: port {port} is already in use; choose another with its port setting", port
        )


def process_tree(pid: int) -> set[int]:
    """`pid` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo.extend(children.get(p, ()))
    return tree


def wait_for_port(
    port: int,
    timeout: float,
    proc: subprocess.Popen | None = None,
    what: str = "",
    host: str = "127.0.0.1",
    log: Path | None = None,
    failed: Callable[[], str] | None = None,
) -> None:
    """Wait until `port` is listened on: by `proc` or one of its descendants when given (a port some
    other process answers on, or a client socket connected to itself, is not `proc` listening), else
    by anyone. StartupFailed when `proc` exits first, or `failed()` names why it cannot start,
    with the end of its `log`; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            why = f"it exited with code {proc.returncode}" if proc.poll() is not None else ""
            why = why or (failed() if failed is not None else "")
            if why:
                excerpt = log_excerpt(log) if log is not None else ""
                where = f"\n{excerpt}\n(its log: {log})" if excerpt else ""
                raise StartupFailed(f"{what} did not start: {why} before listening on port {port}{where}")
            if listens(process_tree(proc.pid), port):
                return
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                if sock.connect_ex((host, port)) == 0:
                    return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL after the grace period."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


def _bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found beside {sys.executable} or on PATH (run `make setup`)")
    return found


@dataclass
class NatsServer:
    """A nats-server with JetStream, data under state_dir."""

    state_dir: Path
    port: int = 4222
    proc: subprocess.Popen | None = None
    config: str = ""  # nats-server configuration (users and permissions: kit/bus/nats_auth.py); "" = none
    host: str = "127.0.0.1"
    """The address it listens on (a host's own address when other hosts connect)."""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        require_free(self.port, "nats-server", self.host)
        store = self.state_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        args = [_bin("nats-server"), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(store)]
        if self.config:
            conf = self.state_dir / "nats-server.conf"
            conf.touch(mode=0o600)  # it holds every service's password
            conf.write_text(self.config)
            args += ["-c", str(conf)]
        log_path = self.state_dir / "nats-server.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environ_without(RAY_VARIABLES + USER_TOKEN_VARIABLES),
            start_new_session=True,
        )
        wait_for_port(self.port, timeout, self.proc, "nats-server", self.host, log=log_path)
        return self

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace)


# On SIGTERM only the raylet exits (within ~0.1 s); `ray start --block`, the GCS and the idle workers
# stay until SIGKILL (measured: 7 of 9 session processes still there after 20 s). The stack's Ray
# state is its own and disposable, so half a second for the raylet, then SIGKILL.
RAY_GRACE_S = 0.5


@dataclass
class RayHead:
    """A Ray head started with `ray start --block` (less its client and API servers, see
    services/kit/ray/start.py) as our own child, token auth on."""

    state_dir: Path
    port: int = 26379
    num_cpus: int = 8
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    """The node's address: where Ray workers on other hosts join (`ray start --address`)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources the head node offers (what recipes' ray_resources fields ask for)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment a client needs to connect to this head."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def ports(self) -> dict[str, int]:
        """Every port the head listens on, by Ray's option (fixed: Ray picks the ones it is not given by
        binding a free port and closing it, in the kernel's ephemeral range, where any connect() can
        take it before the component binds it)."""
        return {"port": self.port, **{name: self.port + 1 + i for i, name in enumerate(RAY_HEAD_PORTS)}}

    def start(self, timeout: float = 60.0) -> RayHead:
        if self.port != 6379 and self.port <= 20000:
            raise ValueError(f"Ray head port must be 6379 or above 20000, got {self.port}")
        for option, port in self.ports().items():
            require_free(port, f"ray head ({option}, its port + {port - self.port})", self.host)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        temp_dir = ray_temp_dir(self.port)
        env = {**environ_without(USER_TOKEN_VARIABLES), **self.env(), "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS")
        log_path = self.state_dir / "ray-head.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.kit.ray.start",  # Ray's `ray start`, less two processes nobody here uses
                "start",
                "--head",
                "--block",
                f"--port={self.port}",
                "--include-dashboard=false",
                # Neither the autoscaler's monitor nor the log monitor (services keep their workers'
                # logs to themselves) has work on a fixed-size local head: two Python processes
                # fewer competing for the cores while the stack comes up.
                "--no-monitor",
                "--include-log-monitor=false",
                f"--num-cpus={self.num_cpus}",
                "--disable-usage-stats",
                f"--node-ip-address={self.host}",
                f"--temp-dir={temp_dir}",
                *(
                    f"--{option.replace('_', '-')}={port}"
                    for option, port in self.ports().items()
                    if option != "port"
                ),
                *([f"--resources={json.dumps(self.resources)}"] if self.resources else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        wait_for_port(
            self.port,
            timeout,
            self.proc,
            "ray head",
            self.host,
            log=log_path,
            failed=_GcsWatch(self.proc.pid, self.port),
        )
        return self

    def stop(self, grace: float = RAY_GRACE_S) -> None:
        if self.proc is not None:
            stop_session(self.proc.pid, grace)
            self.proc.wait(timeout=5)
            keep_ray_logs(self.port, self.state_dir)


# Ray's other fixed ports of the head, at the head's port + 1, + 2, ... (`ray start` options).
RAY_HEAD_PORTS = (
    "node_manager_port",
    "object_manager_port",
    "runtime_env_agent_port",
    "dashboard_agent_grpc_port",
    "dashboard_agent_listen_port",
    "metrics_export_port",
)


class _GcsWatch:
    """Why a starting head cannot come up: its GCS (gcs_server) ran and exited. `ray start` itself
    notices only after its own ~40 s wait; the GCS's log already says why (e.g. its port taken)."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port, self.seen = pid, port, False

    def __call__(self) -> str:
        # Exited, it stays a zombie until `ray start` reaps it after its own wait: pid_alive says gone.
        alive = any(process_name(p) == "gcs_server" and pid_alive(p) for p in process_tree(self.pid))
        self.seen |= alive
        if alive or not self.seen:
            return ""
        logs = ray_temp_dir(self.port) / "session_latest" / "logs"
        said = [
            line
            for name in ("gcs_server.out", "gcs_server.err")
            for line in log_excerpt(logs / name, 20_000).splitlines()
            if re.match(r"^\[[^\]]* [EC] \d+ \d+\]", line)  # Ray's error and fatal log lines
        ]
        return "its GCS (gcs_server) exited" + (f": {said[-1]}" if said else "")


def ray_temp_dir(port: int) -> Path:
    """Where the head on `port` keeps its session: under /tmp, because Ray's temp dir ends up
    inside socket paths, which must stay short (108 bytes)."""
    return Path("/tmp") / f"looprl-ray-{port}"


def keep_ray_logs(port: int, state_dir: Path) -> None:
    """Once the head on `port` has stopped: move its sessions' logs (its actors' output among them)
    to `state_dir`/ray-logs/<session>, beside the services' logs, and remove the sessions from /tmp,
    where every stack would otherwise leave a few MB behind. Every session: a head restarted on the
    same port (`looprl restart ray-head`) starts a new one, and the old one says why it went."""
    temp_dir = ray_temp_dir(port)
    for session in temp_dir.glob("session_*"):
        logs = session / "logs"
        if not session.is_symlink() and logs.is_dir():  # session_latest links to one of the others
            shutil.copytree(
                logs, state_dir / "ray-logs" / session.name, dirs_exist_ok=True, ignore_dangling_symlinks=True
            )
    shutil.rmtree(temp_dir, ignore_errors=True)


def session_pids(sid: int) -> list[int]:
    """Every process of the session led by `sid` (Ray's workers have process groups of their own
    but stay in the head's session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the command: state, ppid, pgrp, session, ...
            pids.append(int(entry))
    return pids


def stop_session(sid: int, grace: float) -> None:
    """SIGTERM the session's process group, SIGKILL whatever of the session is left after grace, and
    wait (briefly) until it is gone."""
    try:
        os.killpg(sid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in session_pids(sid)):
        time.sleep(0.1)
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gone_by = time.monotonic() + 5.0  # SIGKILL is not instant: return once the session is gone
    while time.monotonic() < gone_by and any(pid_alive(p) for p in session_pids(sid)):
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def stop_pid_group(pid: int, grace: float = 10.0) -> bool:
    """SIGTERM the process group led by pid, SIGKILL it after grace; True if it had to be killed."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
        return pid_alive(pid)
    except ProcessLookupError:
        return False
