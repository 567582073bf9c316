"""Replica health and weight versions, as the Router tracks them (Router inherits this).

- a status poll per replica (and weights.published events) updates versions and health; a replica
  whose poll fails also gives up the requests in flight there (`_unreachable`);
- a replica whose version went backwards restarted: it stays out of routing until it serves the
  newest version of its deployment again, its sessions are forgotten, and the service's hook asks
  weight-sync to resync it;
- a replica whose engine reports itself broken is never routed to and is recreated (once per
  breakage).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.handles import ReplicaFailure, ReplicaHandle
from services.inference_router.policies import DeploymentState, ReplicaState, RoutingPolicy
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.split_tuning import SplitTuning
from services.kit.rpc import errors

log = logging.getLogger("looprl.inference_router")


class ReplicaHealth:
    """The health-and-versions half of the Router; the state it reads is the Router's."""

    policy: RoutingPolicy
    config: RouterConfig
    deployments: dict[str, DeploymentState]
    handles: dict[str, ReplicaHandle]
    replicas: dict[str, ReplicaState]
    announced: dict[str, int]
    report_to_run: Callable[..., Awaitable[None]] | None
    _reports: set[asyncio.Task]
    _on_replica_restarted: Callable[[str, str], Awaitable[None]] | None
    _on_replica_broken: Callable[[str, str, str], Awaitable[None]] | None
    _recreating: set[str]
    _unreachable: dict[str, asyncio.Event]
    _poller: asyncio.Task | None
    splits: dict[str, SplitTuning]

    def _notify(self) -> None:
        raise NotImplementedError

    def _replica_failed(self, replica: ReplicaState, exc: ReplicaFailure, run_id: str = "") -> None:
        if exc.overloaded:
            return  # busy, not broken: only this request moves on
        log.warning("replica failed, retrying elsewhere: %s", exc)
        if run_id and self.report_to_run is not None:
            report = asyncio.ensure_future(
                self.report_to_run(run_id, f"replica {replica.name} failed: {exc.why}")
            )
            self._reports.add(report)
            report.add_done_callback(self._reports.discard)
        replica.healthy = False
        replica.last_error = exc.why
        if exc.crashed:
            self._mark_restarting(replica)
        self._export_health(replica)
        self._notify()

    def _mark_restarting(self, replica: ReplicaState) -> None:
        newest = self.newest_version(replica.deployment)
        replica.resync_to_version = newest if newest >= 0 else None
        if self.policy.affinity is not None:
            self.policy.affinity.forget_replica(replica.name)

    def newest_version(self, deployment: str) -> int:
        dep = self.deployments.get(deployment)
        if dep is None:
            return -1
        return max(dep.latest_version, self.announced.get(deployment, -1))

    def observe_status(self, replica: ReplicaState, status: ReplicaStatus | None, error: str = "") -> None:
        """Fold one status poll (or its failure) into the replica's state."""
        was_routable = replica.routable
        if status is None:
            replica.healthy = False
            replica.last_error = error
        else:
            version = status.weight_version
            if version < replica.weight_version and replica.resync_to_version is None:
                # Version went backwards: the process restarted and lost its weights.
                log.warning(
                    "replica %s restarted (version %d -> %d)", replica.name, replica.weight_version, version
                )
                self._mark_restarting(replica)
            address = status.address
            moved = bool(replica.address and address and address != replica.address)
            lacking = (
                replica.resync_to_version is not None
                and version < replica.resync_to_version
                and not replica.sync_requested
            )
            if lacking:
                replica.sync_requested = True
            if moved or lacking:
                # It came back (on a new address, or without the newest weights): resync it once.
                self._restarted(replica)
            replica.weight_version = version
            replica.healthy = status.ready
            replica.holds_for_version = status.holds_for_version
            replica.address = status.address or replica.address
            replica.metrics_address = status.metrics_address
            broken = str((status.engine or {}).get("broken", ""))
            if broken:
                # Its engine may hold mixed weights or stale KV (vllm_engine.py): never route to it,
                # and have it recreated; the new process comes back without weights and is resynced.
                replica.healthy = False
                replica.last_error = broken
                if replica.name not in self._recreating:
                    self._recreating.add(replica.name)
                    self._broken(replica, broken)
            else:
                self._recreating.discard(replica.name)
            dep = self.deployments.get(replica.deployment)  # None once its run ended
            vocab = status.vocab_size
            if vocab > 0 and dep is not None:
                # Learned once weights (and so the model config) arrived; used by validation.
                dep.vocab_size = vocab
            if replica.resync_to_version is not None and version >= replica.resync_to_version:
                log.info("replica %s is back at version %d", replica.name, version)
                replica.resync_to_version = None
                replica.sync_requested = False
            if dep is not None and replica.routable:
                dep.ever_routable = True
            split = self.splits.get(replica.deployment)
            if split is not None and dep is not None:
                split.observe_status(replica.name, status.engine or {})
                split.at_version(dep)
        metrics.REPLICA_VERSION.labels(replica.deployment, replica.name).set(replica.weight_version)
        self._export_health(replica)
        if replica.routable != was_routable or status is not None:
            self._notify()

    def _broken(self, replica: ReplicaState, why: str) -> None:
        log.warning("replica %s is out of service, recreating it: %s", replica.name, why)
        if self._on_replica_broken is not None:
            task = asyncio.get_running_loop().create_task(
                self._on_replica_broken(replica.deployment, replica.name, why)
            )
            task.add_done_callback(_log_failure)

    def _restarted(self, replica: ReplicaState) -> None:
        if self._on_replica_restarted is not None:
            task = asyncio.get_running_loop().create_task(
                self._on_replica_restarted(replica.deployment, replica.name)
            )
            task.add_done_callback(_log_failure)

    @staticmethod
    def _export_health(replica: ReplicaState) -> None:
        metrics.REPLICA_ROUTABLE.labels(replica.deployment, replica.name).set(1 if replica.routable else 0)

    def on_weights_published(self, deployment: str, version: int) -> None:
        if deployment in self.deployments and version > self.announced.get(deployment, -1):
            self.announced[deployment] = version
            self._notify()

    def on_replica_committed(self, replica: ReplicaState, version: int) -> None:
        """Weight-sync committed `version` on this replica (it publishes only after the commit):
        requests waiting for it can go there now, without waiting for a status poll. A replica that
        is being resynced after a restart keeps waiting for its poll (which checks the address)."""
        if replica.resync_to_version is not None or version <= replica.weight_version:
            return
        replica.weight_version = version
        metrics.REPLICA_VERSION.labels(replica.deployment, replica.name).set(version)
        self._notify()

    async def poll_once(self) -> None:
        async def one(name: str) -> None:
            replica, handle = self.replicas.get(name), self.handles.get(name)
            if replica is None or handle is None:
                return  # its deployment was removed meanwhile
            asked_at = replica.weight_version
            try:
                status = await handle.status(self.config.status_timeout_s)
            except (ReplicaFailure, errors.ServiceError) as exc:
                if name not in self.replicas:
                    return
                crashed = getattr(exc, "crashed", False)
                if crashed and replica.resync_to_version is None:
                    self._mark_restarting(replica)
                self.observe_status(replica, None, str(exc))
                self._unreachable.setdefault(name, asyncio.Event()).set()
                return
            if name not in self.replicas:
                return
            lost = self._unreachable.get(name)
            if lost is not None and lost.is_set():
                del self._unreachable[name]  # answering again: new requests wait for it again
            if asked_at <= status.weight_version < replica.weight_version:
                # Answered before a commit weight-sync announced while the poll was out: late, not
                # a restart (a restart answers below what the replica had when it was asked).
                status = dataclasses.replace(status, weight_version=replica.weight_version)
            self.observe_status(replica, status)

        await asyncio.gather(*(one(name) for name in list(self.replicas)))

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("status poll failed")
            await asyncio.sleep(self.config.status_interval_s)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("replica restart hook failed: %s", task.exception())
