"""Surviving the loss of the Ray head: notice it, wait for a new head, and restart this service's
process in place (same pid, same command line) so it joins the new cluster.

A Ray driver cannot move to a new cluster: after the head is gone its core worker is bound to the
old cluster id, and `ray.shutdown()` or `ray.nodes()` abort the process on WrongClusterID. What the
service kept in Ray (trainer ranks, engine replicas, sandbox actors) died with the head anyway, so
the service starts over exactly as after a crash: the trainer resumes its run from the last
checkpoint, the router recreates its deployments and weight-sync gives them the latest version.

A service process opts in with `restart_on_loss()` (run_service does, before anything else runs);
when it joins a head (`joined`, from connect_ray) a daemon thread then probes the head's GCS port
every second and, while it answers, its cluster id. Code that would report a Ray failure as fatal
first asks `head_lost()`: a failure caused by the head's loss is not the run's fault.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("looprl.ray")

PROBE_INTERVAL_S = 1.0
HEAD_LOST_EXIT = 75  # EX_TEMPFAIL: the entrypoint rejoins the new cluster and starts the service again
REJOIN_TIMEOUT_S = 600.0  # after this the process exits 1 and its supervisor (k8s, compose) restarts it


class _Joined:
    address: str = ""
    cluster_id: str = ""
    lost: str = ""
    environ: dict[str, str] | None = None  # set: restart the process on loss, with this environment
    exit_instead: bool = False


_joined = _Joined()


def restart_on_loss(environ: dict[str, str], exit_instead: bool = False) -> None:
    """Make this process restart itself (with `environ`, its environment as it started) when the
    Ray head it joins is lost, or exit with HEAD_LOST_EXIT if `exit_instead`. Only service
    processes do: a test process must never re-exec."""
    _joined.environ, _joined.exit_instead = environ, exit_instead


def _port_open(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def cluster_id(address: str) -> str:
    """The cluster id of the head answering at `address`, or "" when none answers. The port is
    checked first: a GcsClient waits ~40 s for a GCS that is down."""
    if not _port_open(address):
        return ""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, not in Ray's stubs

    try:
        return GcsClient(address=address).cluster_id.hex()
    except Exception:
        return ""


def _head_ready(address: str) -> str:
    """The new head's cluster id once it answers and its own node is alive (ray.init needs both)."""
    if not _port_open(address):
        return ""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, not in Ray's stubs
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    try:
        client = GcsClient(address=address)
        alive = any(info.state == GcsNodeInfo.ALIVE for info in client.get_all_node_info(timeout=5).values())
        return client.cluster_id.hex() if alive else ""
    except Exception:
        return ""


def joined(address: str) -> None:
    """Record the cluster this process just joined, and watch it if the process restarts on loss.
    Only a head's GCS address (host:port) is watched: a Ray client (ray://) reconnects by itself."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    _joined.address, _joined.cluster_id, _joined.lost = address, cluster_id(address), ""
    if _joined.environ is not None:
        threading.Thread(target=_watch, name="ray-head-watch", daemon=True).start()


def left() -> None:
    """This process left its cluster (ray.shutdown): nothing to watch."""
    _joined.address = _joined.cluster_id = _joined.lost = ""


def head_lost() -> str:
    """Why the Ray head this process joined is gone ("" while it is the same head)."""
    if _joined.lost or not _joined.address:
        return _joined.lost
    now = cluster_id(_joined.address)
    if not now:
        return f"the Ray head at {_joined.address} is unreachable"
    if now != _joined.cluster_id:
        return (
            f"the Ray head at {_joined.address} was replaced (cluster {_joined.cluster_id[:8]} -> {now[:8]})"
        )
    return ""


async def park_if_lost(what: str, report: Callable[[str], Awaitable[Any]] | None = None) -> None:
    """Do not return while the joined head is lost in a process that restarts on loss: `what` (a
    Ray failure about to be reported as fatal) is the head's loss, and the restart takes over.
    `report` tells the run why it pauses."""
    import asyncio

    if _joined.environ is None:
        return
    reason = await asyncio.to_thread(head_lost)
    if reason:
        log.warning("%s: %s; the process restarts once a new head is up", what, reason)
        if report is not None:
            await report(f"{reason}; restarting into the new cluster once it is up")
        # The restart never lets this return; the same head answering again does (the failure
        # was then not the head's, and the caller goes on to report it).
        while await asyncio.to_thread(head_lost):
            await asyncio.sleep(PROBE_INTERVAL_S)


def _watch() -> None:
    address = _joined.address
    while _joined.address == address:
        time.sleep(PROBE_INTERVAL_S)
        reason = head_lost()
        if reason:
            _joined.lost = reason
            log.error("%s; restarting this service once a new head is up", reason)
            _rejoin()


def _rejoin() -> None:
    """Wait for a head at the address: a new one restarts the process (never returns); the same
    one answering again (a network blip: the driver outlives ~60 s without its GCS) returns."""
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        new = _head_ready(_joined.address)
        if new == _joined.cluster_id:
            log.warning("the Ray head at %s answers again; going on", _joined.address)
            _joined.lost = ""
            return
        if new:
            if _joined.exit_instead:
                log.warning(
                    "a new Ray head is up; exiting %d for the node to rejoin it first", HEAD_LOST_EXIT
                )
                _flush_logs()
                os._exit(HEAD_LOST_EXIT)
            log.warning("a new Ray head is up at %s; restarting the process", _joined.address)
            restart_process(_joined.environ or dict(os.environ))
        time.sleep(PROBE_INTERVAL_S)
    log.error("no Ray head at %s within %.0fs; exiting", _joined.address, REJOIN_TIMEOUT_S)
    _flush_logs()
    os._exit(1)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


def restart_process(environ: dict[str, str]) -> None:
    """Replace this process with a fresh run of the same command line (never returns)."""
    _flush_logs()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:  # sockets (gRPC, NATS, Ray) and files of this image must not outlive it
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
