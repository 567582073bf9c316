"""Deployment management: turn [[deployments]] specs into replica actors, register external
deployments, keep weight-sync informed of every layout, and follow weight events.

- Each replica of an embedded deployment is one InferenceReplica Ray actor (it owns its TP group)
  created with max_restarts=-1, so Ray restarts a crashed replica; the router keeps a restarted
  replica out of routing until it serves the newest version (router.py) and this module asks
  weight-sync to deliver it (RequestSync).
- External deployments (RegisterDeployment) are servers implementing InferenceEngineService,
  reached over gRPC.
- Every deployment registers its layout and rank addresses with weight-sync (RegisterTarget) when
  an address is configured: one target per replica (replicas sync independently), or, for a
  deployment with `canary = true`, ONE target listing every replica's ranks (each named by its
  replica) with the canary policy, so weight-sync commits a new version on the first replica,
  checks its golden prompts and only then lets the others switch (or rolls it back).
- weights.published events on the bus wake the router to re-poll; a weights-rejected event (same
  subject, header `looprl-event: weights-rejected`) is logged and otherwise ignored.
- A replica whose version went backwards is normally a restarted one; a canary replica that rolled
  a rejected version back says so in its status (`rolled_back_version`) and is not resynced.
- A replica whose engine reports itself broken (status engine["broken"]: a vLLM swap that failed
  after a rank loaded, or a prefix-cache reset that failed) is killed with restart
  (`recreate_replica`, asked by the router once per breakage), then resynced like any restart.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from looprl.events.v1 import events_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.handles import GrpcReplicaHandle, RayReplicaHandle, ReplicaHandle
from services.inference_router.policies import DeploymentState, LengthProfile, ReplicaState
from services.inference_router.router import Router
from services.kit import errors, telemetry, tls
from services.kit.recipe import DeploymentSpec

log = logging.getLogger("looprl.inference_router.deployments")


# The recipe writes "unbounded" as a huge number; the proto uses 0.
_UNBOUNDED = 1 << 30


def profile_of(spec: DeploymentSpec) -> LengthProfile:
    def bound(v: int) -> int:
        return 0 if v >= _UNBOUNDED else v

    return LengthProfile(
        min_prompt_tokens=spec.min_prompt_tokens,
        max_prompt_tokens=bound(spec.max_prompt_tokens),
        min_output_tokens=spec.min_output_tokens,
        max_output_tokens=bound(spec.max_output_tokens),
    )


def replica_actor_options(spec: DeploymentSpec, config: RouterConfig, index: int) -> dict[str, Any]:
    """Ray options of replica `index` of `spec` (pure, so CPU tests can check the GPU request)."""
    return {
        "name": f"{spec.name}/{index}",
        "namespace": config.namespace,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": 1000,
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.gpus_per_replica,  # the gateway's admission counts the same
        # Custom resources pin the replicas to the nodes that offer them (recipe).
        "resources": dict(spec.ray_resources) or None,
    }


def replica_name(deployment: str, index: int) -> str:
    return f"{deployment}-r{index}"


class DeploymentManager:
    def __init__(self, router: Router, config: RouterConfig) -> None:
        self.router = router
        self.config = config
        self.specs: dict[str, DeploymentSpec] = {}
        self.actors: dict[str, Any] = {}
        self._weight_sync: Any = None
        self._every_k: dict[str, int] = {}
        self._where: dict[str, str] = {}  # deployment -> its place in the recipe, for errors
        self._bus: Any = None
        self._subscription: Any = None

    # ---- embedded deployments ----------------------------------------------------------------

    async def start(
        self, spec: DeploymentSpec, ready_timeout_s: float = 120.0, where: str = "", run_id: str = ""
    ) -> DeploymentState:
        """Create the replica actors of one deployment and add it to the router; `where` is the
        deployment's place in the recipe (deployments[i]), named by errors about its settings.
        `run_id`: the run it is started for (`spec.name` is then already the run's scoped name, and
        the deployment serves only that run); static deployments serve the config's run_id. A start
        that fails or is cancelled leaves nothing behind."""
        if spec.name in self.router.deployments:
            raise errors.AlreadyExists(f"deployments.name: deployment {spec.name!r} already exists")
        state = DeploymentState(
            name=spec.name,
            profile=profile_of(spec),
            max_model_len=spec.max_model_len,
            max_outstanding_requests=self.config.deployment_max_outstanding,
            backend=spec.backend,
            tensor_parallel=spec.tensor_parallel,
            run_id=run_id or self.config.run_id,
            for_run=bool(run_id),
        )
        try:
            return await self._start(spec, state, ready_timeout_s, where)
        except BaseException:
            await self.remove(spec.name, [replica_name(spec.name, i) for i in range(spec.replicas)])
            raise

    async def _start(
        self, spec: DeploymentSpec, state: DeploymentState, ready_timeout_s: float, where: str
    ) -> DeploymentState:
        from services.inference_router.replica import InferenceReplica

        handles: list[ReplicaHandle] = []
        for index in range(spec.replicas):
            name = replica_name(spec.name, index)
            actor = InferenceReplica.options(**replica_actor_options(spec, self.config, index)).remote(
                spec=spec,
                host=self.config.replica_host,
                replica=name,
                tracing=telemetry.exporter_settings(),
                tls_credentials=tls.export(),
            )
            self.actors[name] = actor
            handles.append(RayReplicaHandle(name, actor))
            state.replicas.append(
                ReplicaState(
                    name=name, deployment=spec.name, max_outstanding_requests=spec.max_queued_requests
                )
            )
        await asyncio.gather(*(_await_alive(h, ready_timeout_s) for h in handles))
        self.router.add_deployment(state, handles)
        self.specs[spec.name] = spec
        self._where[spec.name] = where or f"deployments[{spec.name}]"
        await self.router.poll_once()
        await self._describe_from_status(state, handles)
        await self.register_with_weight_sync(state, spec.sync_every, strict=True)
        return state

    async def _describe_from_status(self, state: DeploymentState, handles: list[ReplicaHandle]) -> None:
        """Fill the layout facts a replica knows about itself (vocab, layout, dtype)."""
        try:
            status = await handles[0].status(self.config.request_timeout_s)
        except Exception:  # a replica that fails now is handled by the poller
            return
        state.vocab_size = status.vocab_size
        state.layout = status.layout or state.layout
        state.dtype = status.dtype or state.dtype

    async def remove(self, name: str, replicas: list[str] | None = None) -> list[str]:
        """Take deployment `name` out of routing and kill its replica actors (without restart, so
        their Ray resources are free); returns its weight-sync targets. `replicas`: the actor names
        to kill when the deployment never reached the router (a failed start)."""
        import ray

        state = await self.router.remove_deployment(name)
        if state is not None:
            replicas = [r.name for r in state.replicas]
        replicas = replicas or []
        targets = [name] if self._canary(name) else list(replicas)
        for replica in replicas:
            actor = self.actors.pop(replica, None)
            if actor is None:
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.warning("could not kill replica %s: %s", replica, exc)
        self.specs.pop(name, None)
        self._every_k.pop(name, None)
        self._where.pop(name, None)
        return targets

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

    async def stop(self) -> None:
        import ray

        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.warning("could not kill replica: %s", exc)
        self.actors.clear()
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        if self._bus is not None:
            await self._bus.close()

    # ---- external deployments ------------------------------------------------------------------

    async def register_external(self, info: inference_pb2.DeploymentInfo) -> DeploymentState:
        if not info.name:
            raise errors.InvalidArgument("deployment.name: must not be empty")
        if info.name in self.router.deployments:
            raise errors.AlreadyExists(f"deployment.name: deployment {info.name!r} already exists")
        if not info.replicas or any(not r.address for r in info.replicas):
            raise errors.InvalidArgument("deployment.replicas: each replica needs an address")
        if info.max_model_len <= 0:
            raise errors.InvalidArgument(f"deployment.max_model_len: must be > 0, got {info.max_model_len}")
        p = info.profile
        profile = LengthProfile(
            p.min_prompt_tokens, p.max_prompt_tokens, p.min_output_tokens, p.max_output_tokens
        )
        try:
            profile.validate("deployment.profile")
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        state = DeploymentState(
            name=info.name,
            profile=profile,
            max_model_len=info.max_model_len,
            max_outstanding_requests=self.config.deployment_max_outstanding,
            backend=info.backend or "external",
            tensor_parallel=info.tensor_parallel or 1,
            layout=info.layout or "hf",
            dtype=info.dtype or "float32",
            external=True,
            run_id=info.run_id,
        )
        handles: list[ReplicaHandle] = []
        for i, r in enumerate(info.replicas):
            name = r.name or replica_name(info.name, i)
            handles.append(GrpcReplicaHandle(name, r.address, self.config.max_message_bytes))
            state.replicas.append(
                ReplicaState(
                    name=name,
                    deployment=info.name,
                    address=r.address,
                    max_outstanding_requests=int(r.outstanding_requests) or 256,
                )
            )
        self.router.add_deployment(state, handles)
        await self.router.poll_once()
        await self.register_with_weight_sync(state, 1)
        return state

    # ---- weight-sync and events ----------------------------------------------------------------

    def _canary(self, deployment: str) -> bool:
        spec = self.specs.get(deployment)
        return bool(spec is not None and spec.canary)

    def sync_target(self, deployment: str, replica: str) -> str:
        """The weight-sync target a replica belongs to: its deployment when canaried, else itself."""
        return deployment if self._canary(deployment) else replica

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
        if self._canary(state.name):
            await self._register(state, state.name, state.replicas, strict)
        else:
            await asyncio.gather(*(self._register(state, r.name, [r], strict) for r in state.replicas))

    async def register_replica(self, state: DeploymentState, replica: ReplicaState) -> None:
        """(Re-)register the target `replica` belongs to, at the replicas' current addresses."""
        if self._canary(state.name):
            await self._register(state, state.name, state.replicas)
        else:
            await self._register(state, replica.name, [replica])

    async def _register(
        self, state: DeploymentState, target: str, replicas: list[ReplicaState], strict: bool = False
    ) -> None:
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
                return
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
                return
            log.warning("weight-sync registration of %s failed: %s", target, exc)
            return
        if reply.current_version >= 0:
            self.router.on_weights_published(state.name, reply.current_version)
        log.info(
            "registered %s with weight-sync (%d ranks%s)",
            target,
            len(ranks),
            ", canary" if request.canary else "",
        )

    def _weight_sync_stub(self) -> Any:
        if self._weight_sync is None:
            from looprl.weightsync.v1 import weightsync_pb2_grpc
            from services.kit.server import open_channel

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

    async def recreate_replica(self, deployment: str, replica: str, why: str) -> None:
        """A replica whose engine took itself out of service (a weight swap that may have left its
        ranks on different versions, or KV from old weights): kill its process so Ray restarts the
        actor (max_restarts=-1); the router then sees a restart and weight-sync resyncs it.
        External replicas are only routed around: their operator restarts them."""
        actor = self.actors.get(replica)
        if actor is None:
            log.warning(
                "replica %s of %s is out of service and not ours to recreate: %s", replica, deployment, why
            )
            return
        import ray

        log.warning("recreating replica %s of %s: %s", replica, deployment, why)
        ray.kill(actor, no_restart=False)

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
        from services.kit import subjects
        from services.kit.bus import Bus

        self._bus = await Bus.connect(nats_url, name="inference-router")
        # Every run's events when deployments are started per run: each names its run's replicas.
        one_run = self.config.run_id and not self.config.watch_runs
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

    def describe(self) -> list[inference_pb2.DeploymentInfo]:
        out = []
        for dep in self.router.deployment_list():
            p = dep.profile
            out.append(
                inference_pb2.DeploymentInfo(
                    name=dep.name,
                    backend=dep.backend,
                    tensor_parallel=dep.tensor_parallel,
                    profile=inference_pb2.LengthProfile(
                        min_prompt_tokens=p.min_prompt_tokens,
                        max_prompt_tokens=p.max_prompt_tokens,
                        min_output_tokens=p.min_output_tokens,
                        max_output_tokens=p.max_output_tokens,
                    ),
                    max_model_len=dep.max_model_len,
                    layout=dep.layout,
                    dtype=dep.dtype,
                    run_id=dep.run_id,
                    replicas=[
                        inference_pb2.ReplicaInfo(
                            name=r.name,
                            healthy=r.routable,
                            weight_version=r.weight_version,
                            outstanding_tokens=r.outstanding_tokens,
                            outstanding_requests=r.outstanding_requests,
                            address=r.address,
                        )
                        for r in dep.replicas
                    ],
                )
            )
        return out


async def _await_alive(handle: ReplicaHandle, timeout_s: float) -> None:
    """The actor's constructor finished (it may still lack weights: status says ready=False)."""
    await handle.status(timeout_s)


def _run_of(subject: str) -> str:
    from services.kit import subjects

    try:
        return subjects.run_of(subject)
    except ValueError:
        return ""


def _refused_transport(exc: BaseException) -> str:
    """Weight-sync's reason for refusing a registration's weight_transport ("" for any other error)."""
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        details = exc.details() or ""
        if details.startswith("weight_transport:"):
            return details
    return ""
