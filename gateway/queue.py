"""The run queue: which waiting runs start now, and where and why the others wait.

A run starts when it fits: its tenant has fewer than max_concurrent_runs started runs, and the
cluster's free Ray resources hold its demand (gateway/admission.py `run_demand`). Free is the
cluster's total (`ClusterResources`, every alive node's resources, as the inference-router reads
them from the Ray cluster it joined) minus the larger of
two counts of what is taken: the demand of every run the gateway started and has not ended (from
their recipes: Ray's own count lags behind runs whose actors are still being created), and what Ray
says is in use now (which also holds what no run asked for: the services' own workers, such as
sandbox fleets and reward-model replicas, shared by every run). A run that fits, but not now, waits
in state "queued" (its record in KV; nothing may start for it); one that could never fit is refused
at CreateRun.

The queue is ordered by tenant priority (higher first), then age (`queue_order`). `plan` walks it in
that order and starts every run that fits. A run waiting for cluster resources holds every run behind
it back from the cluster, so a large run of a high-priority tenant is not starved by smaller later
ones; a run waiting only for its own tenant's max_concurrent_runs holds back no one else.

Without an inference-router only the tenants' quotas apply; a cluster that cannot be read admits
nothing new until it answers (`ClusterResources`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from gateway.admission import Demand, concurrency_reason
from gateway.config import Tenant
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.config.recipe import RunRecord
from services.kit.rpc.errors import Unavailable

log = logging.getLogger("looprl.gateway.queue")

QUEUED = "queued"
# Records of runs the gateway started and that have not ended: their demand is held on the cluster.
STARTED = ("pending", "running", "stalled", "stopping")

# How long a read of the cluster's total resources is reused: nodes join and leave rarely.
CLUSTER_TTL_S = 5.0


@dataclass(frozen=True)
class ClusterState:
    """The alive nodes' resources summed: in all, and in use now (held by actors and placement groups)."""

    total: dict[str, float]
    in_use: dict[str, float]


class ClusterResources:
    """The Ray cluster's resources (summed over alive nodes), as the inference-router reports them
    (GetClusterResources: it is a Ray driver; the gateway holds no Ray token and never joins the
    cluster); cached for CLUSTER_TTL_S. None without a router or with one that does not implement the RPC: then
    only the tenants' quotas apply. A
    cluster that does not answer is never taken for an unlimited one: the last state read stands in,
    and before any read succeeded `state` raises Unavailable (nothing is admitted)."""

    def __init__(
        self,
        router: inference_pb2_grpc.InferenceRouterServiceStub | None,
        ttl_s: float = CLUSTER_TTL_S,
        attempts: int = 3,
    ) -> None:
        self.router, self.ttl_s, self.attempts = router, ttl_s, attempts
        self._read_at = float("-inf")
        self._state: ClusterState | None = None

    async def total(self) -> dict[str, float] | None:
        state = await self.state()
        return None if state is None else state.total

    async def state(self) -> ClusterState | None:
        if self.router is None:
            return None
        if time.monotonic() - self._read_at < self.ttl_s:
            return self._state
        why = ""
        for attempt in range(self.attempts):
            try:
                reply = await self.router.GetClusterResources(
                    inference_pb2.GetClusterResourcesRequest(), timeout=10.0
                )
                self._state = ClusterState(dict(reply.total), dict(reply.in_use))
                self._read_at = time.monotonic()
                return self._state
            except grpc.aio.AioRpcError as exc:  # down, restarting, or no node registered yet
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    # A router of the user's own (`looprl up --use`) that places nothing on a Ray
                    # cluster: only the tenants' quotas apply, as without a router.
                    log.warning("the inference-router does not report cluster resources: %s", exc.details())
                    self.router = None
                    return None
                why = f"{exc.code().name}: {exc.details()}"
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(1.0)
        log.warning("cannot read the Ray cluster's resources from the inference-router: %s", why)
        if self._state is not None:
            return self._state
        raise Unavailable(f"cluster: the inference-router did not say the Ray cluster's resources ({why})")


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
    in_use: Mapping[str, float] | None = None,
) -> list[tuple[Waiting, str]]:
    """The queue in order, each run with why it waits ("" for a run that starts now). `started` are the
    runs holding resources (their tenants' slots and their demand on the cluster); `in_use` is what
    Ray holds now, which counts where it exceeds their demand (workers no run asked for)."""
    active: dict[str, int] = {}
    held: dict[str, float] = {}
    shared: frozenset[str] = frozenset()  # shared deployments whose replicas a started run holds
    capacities: dict[str, float] = {}  # adapter slots of shared deployments (virtual resources)
    for record in started:
        active[record.tenant] = active.get(record.tenant, 0) + 1
        demand = demand_of(record)
        for resource, amount in demand.resources(shared).items():
            held[resource] = held.get(resource, 0.0) + amount
        shared |= demand.shared
        capacities.update(demand.capacities())
    for w in waiting:
        capacities.update(w.demand.capacities())
    free = None
    only_slots = total is None  # no cluster to read: the tenants' quotas and the adapter slots apply
    if total is not None or capacities:
        total = {**(total or {}), **capacities}
        taken = {r: max(held.get(r, 0.0), (in_use or {}).get(r, 0.0)) for r in {*held, *(in_use or {})}}
        free = {r: total.get(r, 0.0) - taken.get(r, 0.0) for r in {*total, *taken}}
    blocked_by = ""  # the first resource a run ahead waits for: nobody behind takes the cluster
    out = []
    for w in queue_order(waiting):
        reason = concurrency_reason(w.tenant, active.get(w.tenant.name, 0))
        if not reason and free is not None:
            if blocked_by:
                reason = f"cluster {blocked_by}: behind a run queued ahead of it that waits for {blocked_by}"
            else:
                for resource, amount in w.demand.resources(shared).items():
                    if only_slots and resource not in capacities:
                        continue
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
                for resource, amount in w.demand.resources(shared).items():
                    free[resource] = free.get(resource, 0.0) - amount
            shared |= w.demand.shared
        out.append((w, reason))
    return out
