"""The run queue: which waiting runs start now, and where and why the others wait.

A run starts when it fits: its tenant has fewer than max_concurrent_runs started runs, and the
cluster's free Ray resources hold its demand (gateway/admission.py `run_demand`). Free is the
cluster's total (`ClusterResources`, every alive node's resources in the Ray GCS) minus the demand of
every run the gateway started and has not ended, computed from their recipes: Ray's own available
resources lag behind runs whose actors are still being created. A run that fits, but not now, waits
in state "queued" (its record in KV; nothing may start for it); one that could never fit is refused
at CreateRun.

The queue is ordered by tenant priority (higher first), then age (`queue_order`). `plan` walks it in
that order and starts every run that fits. A run waiting for cluster resources holds every run behind
it back from the cluster, so a large run of a high-priority tenant is not starved by smaller later
ones; a run waiting only for its own tenant's max_concurrent_runs holds back no one else.

Without a Ray address (or while the GCS cannot be read) only the tenants' quotas apply.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.admission import Demand, concurrency_reason
from gateway.config import Tenant
from services.kit.recipe import RunRecord

log = logging.getLogger("looprl.gateway.queue")

QUEUED = "queued"
# Records of runs the gateway started and that have not ended: their demand is held on the cluster.
STARTED = ("pending", "running", "stalled", "stopping")

# How long a read of the cluster's total resources is reused: nodes join and leave rarely.
CLUSTER_TTL_S = 5.0


class ClusterResources:
    """The Ray cluster's total resources (summed over alive nodes), read from the GCS at `address`
    (host:port) without joining the cluster as a driver; cached for CLUSTER_TTL_S. None when no
    address is given, or the GCS cannot be read: then only the tenants' quotas apply."""

    def __init__(self, address: str, ttl_s: float = CLUSTER_TTL_S) -> None:
        self.address, self.ttl_s = address, ttl_s
        self._read: tuple[float, dict[str, float] | None] = (float("-inf"), None)

    async def total(self) -> dict[str, float] | None:
        if not self.address:
            return None
        at, total = self._read
        if time.monotonic() - at < self.ttl_s:
            return total
        try:
            total = await asyncio.to_thread(read_cluster_total, self.address)
        except Exception as exc:
            log.warning("cannot read the Ray cluster's resources at %s: %r", self.address, exc)
            total = None
        self._read = (time.monotonic(), total)
        return total


def read_cluster_total(address: str) -> dict[str, float] | None:
    """Every alive node's resources summed, from the GCS at `address` (host:port); None for an address
    that is not a GCS host:port (ray://, auto), a GCS that does not answer, or a cluster with no alive
    node yet (a head just started registers its own node seconds later)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None
    try:
        # A GcsClient waits ~40 s for a GCS that is down: check its port first.
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
    except OSError:
        return None
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    total: dict[str, float] = {}
    alive = [
        i
        for i in GcsClient(address=address).get_all_node_info(timeout=5).values()
        if i.state == GcsNodeInfo.ALIVE
    ]
    for info in alive:
        for name, amount in info.resources_total.items():
            total[name] = total.get(name, 0.0) + amount
    return total if alive else None


def _n(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Waiting:
    """A queued run: its record, its tenant (quota and priority) and its demand."""

    record: RunRecord
    tenant: Tenant
    demand: Demand


def queue_order(waiting: Sequence[Waiting]) -> list[Waiting]:
    """Higher tenant priority first, then the oldest."""
    return sorted(waiting, key=lambda w: (-w.tenant.priority, w.record.created_at, w.record.run_id))


def plan(
    waiting: Sequence[Waiting],
    started: Sequence[RunRecord],
    demand_of: Callable[[RunRecord], Demand],
    total: Mapping[str, float] | None,
) -> list[tuple[Waiting, str]]:
    """The queue in order, each run with why it waits ("" for a run that starts now). `started` are the
    runs holding resources (their tenants' slots and their demand on the cluster)."""
    active: dict[str, int] = {}
    free = dict(total) if total is not None else None
    for record in started:
        active[record.tenant] = active.get(record.tenant, 0) + 1
        if free is not None:
            for resource, amount in demand_of(record).resources().items():
                free[resource] = free.get(resource, 0.0) - amount
    blocked_by = ""  # the first resource a run ahead waits for: nobody behind takes the cluster
    out = []
    for w in queue_order(waiting):
        reason = concurrency_reason(w.tenant, active.get(w.tenant.name, 0))
        if not reason and free is not None:
            if blocked_by:
                reason = f"cluster {blocked_by}: behind a run queued ahead of it that waits for {blocked_by}"
            else:
                for resource, amount in w.demand.resources().items():
                    have = free.get(resource, 0.0)
                    if amount > have + 1e-9:
                        blocked_by = resource
                        reason = (
                            f"cluster {resource}: needs {_n(amount)}, {_n(max(have, 0.0))} of "
                            f"{_n(total.get(resource, 0.0))} free"  # type: ignore[union-attr]
                        )
                        break
        if not reason:
            active[w.tenant.name] = active.get(w.tenant.name, 0) + 1
            if free is not None:
                for resource, amount in w.demand.resources().items():
                    free[resource] = free.get(resource, 0.0) - amount
        out.append((w, reason))
    return out
