"""How the router's deployments meet weight-sync and its events (DeploymentManager inherits this).

- Every deployment registers its layout and rank addresses with weight-sync (RegisterTarget) when
  an address is configured, for the run it serves: one target per replica (replicas sync
  independently), or, for a deployment with `canary = true`, ONE target listing every replica's
  ranks (each named by its replica) with the canary policy, so weight-sync commits a new version on
  the first replica, checks its golden prompts and only then lets the others switch (or rolls it
  back). A disaggregated deployment is likewise ONE target of all its prefill and decode workers
  (no canary): weight-sync stages a version on every worker and commits it on all of them only once
  every one holds it verified. A run's deployments unregister their targets when the run ends (UnregisterTarget). A
  registration weight-sync could not take (it is starting or restarting: UNAVAILABLE, or no answer
  in time) is tried again in the background, backing off to 5 s, until weight-sync answers or the
  replicas are gone: a target registered once at start and lost would never receive weights.
- A restarted replica is registered again and resynced (RequestSync); a canary replica that rolled
  a rejected version back says so in its status (`rolled_back_version`) and is not resynced.
- weights.published events on the bus wake the router to re-poll; an event applies only to the
  deployments of the run whose subject it came on. A weights-rejected event (same subject, header
  `looprl-event: weights-rejected`) is logged and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from looprl.events.v1 import events_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.policies import DeploymentState, ReplicaState
from services.inference_router.router import Router
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc import errors

if TYPE_CHECKING:
    from services.kit.bus.client import Bus

log = logging.getLogger("looprl.inference_router.deployments")


class WeightSyncLink:
    """The weight-sync half of the DeploymentManager; the state it reads is the manager's."""

    router: Router
    config: RouterConfig
    specs: dict[str, DeploymentSpec]
    _weight_sync: Any
    _every_k: dict[str, int]
    _where: dict[str, str]
    _bus: Bus
    _subscription: Any
    _registering: dict[str, asyncio.Task]

    def _one_target(self, deployment: str) -> bool:
        """Whether the deployment's replicas are one weight-sync target (canary, disaggregated)."""
        spec = self.specs.get(deployment)
        return bool(spec is not None and (spec.canary or spec.disaggregation is not None))

    def sync_target(self, deployment: str, replica: str) -> str:
        """The weight-sync target a replica belongs to: its deployment when canaried or
        disaggregated, else itself."""
        return deployment if self._one_target(deployment) else replica

    async def register_with_weight_sync(
        self, state: DeploymentState, every_k: int, strict: bool = False
    ) -> None:
        """One weight-sync target per replica (a target is one TP group), named after the replica;
        a canary deployment is one target of all its replicas, the first replica the canary. With
        `strict`, a weight_transport weight-sync refuses raises InvalidArgument naming the recipe field
        (the deployment cannot receive weights the way its recipe says)."""
        if not self.config.weight_sync_address:
            return
        self._every_k[state.name] = max(1, every_k)
        if self._one_target(state.name):
            await self._register(state, state.name, state.replicas, strict)
        else:
            await asyncio.gather(*(self._register(state, r.name, [r], strict) for r in state.replicas))

    async def register_replica(self, state: DeploymentState, replica: ReplicaState) -> None:
        """(Re-)register the target `replica` belongs to, at the replicas' current addresses."""
        if self._one_target(state.name):
            await self._register(state, state.name, state.replicas)
        else:
            await self._register(state, replica.name, [replica])

    async def _register(
        self,
        state: DeploymentState,
        target: str,
        replicas: list[ReplicaState],
        strict: bool = False,
        retry: bool = True,
    ) -> bool:
        """RegisterTarget for `target`; False when weight-sync could not take it for now (then, with
        `retry`, it is tried again in the background)."""
        from looprl.common.v1 import common_pb2
        from looprl.weightsync.v1 import weightsync_pb2

        ranks = []
        for replica, (addresses, host_id) in zip(
            replicas, await asyncio.gather(*(self._rank_addresses(r) for r in replicas)), strict=True
        ):
            if len(addresses) != state.tensor_parallel:
                log.warning(
                    "replica %s reported %d rank addresses for tp=%d; %s not registered",
                    replica.name,
                    len(addresses),
                    state.tensor_parallel,
                    target,
                )
                return True
            ranks += [
                weightsync_pb2.TargetRank(rank=rank, address=address, replica=replica.name, host_id=host_id)
                for rank, address in enumerate(addresses)
            ]
        dtype = {"bfloat16": common_pb2.D_TYPE_BFLOAT16, "float16": common_pb2.D_TYPE_FLOAT16}.get(
            state.dtype, common_pb2.D_TYPE_FLOAT32
        )
        request = weightsync_pb2.RegisterTargetRequest(
            deployment=target,
            layout=weightsync_pb2.TargetLayout(
                tensor_parallel=state.tensor_parallel, naming=state.layout, dtype=dtype
            ),
            ranks=ranks,
            every_k_versions=self._every_k.get(state.name, 1),
            run_id=state.run_id,
            adapter=state.adapter,
        )
        spec = self.specs.get(state.name)
        if spec is not None:
            request.weight_transport = spec.weight_transport
        if spec is not None and spec.canary:
            request.canary = True
            request.canary_policy.max_logprob_drift = spec.canary_max_logprob_drift
            request.canary_policy.tokens_per_prompt = spec.canary_tokens_per_prompt
        try:
            reply = await self._weight_sync_stub().RegisterTarget(request, timeout=10)
        except Exception as exc:
            refused = _refused_transport(exc)
            if refused:
                where = self._where.get(state.name, f"deployments[{state.name}]")
                log.error("weight-sync refused %s: %s.%s", target, where, refused)
                if strict:
                    raise errors.InvalidArgument(f"{where}.{refused}") from None
                return True
            if not _transient(exc):
                log.warning("weight-sync registration of %s failed: %s", target, exc)
                return True
            if retry:
                log.warning("weight-sync registration of %s failed, trying again: %s", target, exc)
                self._register_later(state, target, replicas)
            return False
        if reply.current_version >= 0:
            self.router.on_weights_published(state.name, reply.current_version)
        log.info(
            "registered %s with weight-sync (%d ranks%s)",
            target,
            len(ranks),
            ", canary" if request.canary else "",
        )
        return True

    def _register_later(self, state: DeploymentState, target: str, replicas: list[ReplicaState]) -> None:
        """Try `target`'s registration again, backing off to 5 s, while its replicas are served here."""
        if target in self._registering:
            return

        async def again() -> None:
            delay = 0.25
            while all(self.router.replicas.get(r.name) is r for r in replicas):
                await asyncio.sleep(delay)
                if await self._register(state, target, replicas, retry=False):
                    return
                delay = min(2 * delay, 5.0)

        task = asyncio.get_running_loop().create_task(again(), name=f"register {target}")
        self._registering[target] = task
        task.add_done_callback(lambda _task: self._registering.pop(target, None))

    def _weight_sync_stub(self) -> Any:
        if self._weight_sync is None:
            from looprl.weightsync.v1 import weightsync_pb2_grpc
            from services.kit.rpc.server import open_channel

            self._weight_sync = weightsync_pb2_grpc.WeightSyncServiceStub(
                open_channel(self.config.weight_sync_address, self.config.max_message_bytes)
            )
        return self._weight_sync

    async def _rank_addresses(self, replica: ReplicaState) -> tuple[list[str], str]:
        """The replica's rank addresses and the host identity it reports ("" when unknown)."""
        handle = self.router.handles[replica.name]
        try:
            status = await handle.status(self.config.request_timeout_s)
        except Exception:
            return ([replica.address] if replica.address else []), ""
        if status.rank_addresses:
            return list(status.rank_addresses), status.host_id
        address = status.address or replica.address
        return ([address] if address else []), status.host_id

    async def unregister_targets(self, targets: list[str]) -> None:
        """Tell weight-sync these targets are gone; a weight-sync that is down only costs a log line
        (it drops targets it cannot reach when it delivers)."""
        if not self.config.weight_sync_address:
            return
        from looprl.weightsync.v1 import weightsync_pb2

        for target in targets:
            try:
                await self._weight_sync_stub().UnregisterTarget(
                    weightsync_pb2.UnregisterTargetRequest(deployment=target), timeout=10
                )
                log.info("unregistered %s from weight-sync", target)
            except Exception as exc:
                log.warning("weight-sync unregistration of %s failed: %s", target, exc)

    async def request_sync(self, deployment: str, replica: str) -> None:
        """A restarted replica lacks the newest weights and listens on a new address: register it
        again (weight-sync then delivers the latest version to it) and ask for the sync."""
        if await self._rolled_back(replica):
            return
        if not self.config.weight_sync_address:
            log.info("replica %s restarted; no weight-sync configured to resync it", replica)
            return
        from looprl.weightsync.v1 import weightsync_pb2

        await self.register_replica(self.router.deployments[deployment], self.router.replicas[replica])
        try:
            reply = await self._weight_sync_stub().RequestSync(
                weightsync_pb2.RequestSyncRequest(deployment=self.sync_target(deployment, replica)),
                timeout=30,
            )
        except Exception as exc:  # e.g. no version pushed yet: registration alone suffices then
            log.info("RequestSync for %s: %s", replica, exc)
            return
        log.info("asked weight-sync to resync %s (version %d)", replica, reply.version)

    async def _rolled_back(self, name: str) -> bool:
        """A canary replica that rolled back a rejected version looks to the router like a restart
        (its version went backwards). It is not one: it kept its process, address and weights, so
        it routes again at once and needs no resync."""
        replica = self.router.replicas.get(name)
        if replica is None or replica.resync_to_version is None:
            return False
        try:
            status = await self.router.handles[name].status(self.config.request_timeout_s)
        except Exception:
            return False
        rolled_back = status.rolled_back_version
        if rolled_back < 0 or rolled_back < replica.resync_to_version:
            return False
        log.info("replica %s rolled back version %d (not a restart): routable again", name, rolled_back)
        replica.resync_to_version = None
        replica.sync_requested = False
        self.router.observe_status(replica, status)
        return True

    async def follow_weight_events(self, nats_url: str) -> Any:
        """weights.published wakes the router (re-poll at once) and records the announced version;
        returns the bus connection."""
        from services.kit.bus import subjects
        from services.kit.bus.client import Bus

        self._bus = await Bus.connect(nats_url, name="inference-router")
        # Every run's events when deployments are started per run: each names its run's replicas.
        one_run = self.config.run_id and not self.config.starts_run_deployments
        subject = subjects.weights(self.config.run_id) if one_run else subjects.all_runs("weights")

        async def on_message(msg: Any) -> None:
            if (msg.headers or {}).get(subjects.EVENT_HEADER) == subjects.WEIGHTS_REJECTED:
                try:
                    rejected = events_pb2.WeightsRejected.FromString(msg.data)
                    log.warning(
                        "weight-sync rejected version %d for %s (log-prob drift %.4g)",
                        rejected.version,
                        rejected.deployment,
                        rejected.drift,
                    )
                except Exception:
                    log.warning("ignoring a malformed weights-rejected event on %s", msg.subject)
                return
            try:
                event = events_pb2.WeightsPublished.FromString(msg.data)
            except Exception:
                log.warning("ignoring a malformed weights event on %s", msg.subject)
                return
            # Targets are replicas; events name the replica (or a whole deployment).
            replica = self.router.replicas.get(event.deployment)
            deployment = self.router.deployments.get(replica.deployment if replica else event.deployment)
            if deployment is not None and deployment.run_id and _run_of(msg.subject) != deployment.run_id:
                return  # another run's weights: never this deployment's version
            self.router.on_weights_published(
                replica.deployment if replica else event.deployment, event.version
            )
            if replica is not None:
                # The event is the commit itself: no status round trip on every step's critical path.
                self.router.on_replica_committed(replica, event.version)
            else:
                await self.router.poll_once()

        self._subscription = await self._bus.nc.subscribe(subject, cb=on_message)
        return self._bus


def _run_of(subject: str) -> str:
    from services.kit.bus import subjects

    try:
        return subjects.run_of(subject)
    except ValueError:
        return ""


def _transient(exc: BaseException) -> bool:
    """Weight-sync is not there or not ready yet: asking again later may succeed."""
    import grpc

    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


def _refused_transport(exc: BaseException) -> str:
    """Weight-sync's reason for refusing a registration's weight_transport ("" for any other error)."""
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        details = exc.details() or ""
        if details.startswith("weight_transport:"):
            return details
    return ""
