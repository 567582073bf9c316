"""Deployment management: turn [[deployments]] specs into replica actors (static ones from the
config, a run's from its recipe: runs.py), register external deployments, and free a deployment.

- Each replica of an embedded deployment is one InferenceReplica Ray actor (it owns its TP group)
  created with max_restarts=-1, so Ray restarts a crashed replica; the router keeps a restarted
  replica out of routing until it serves the newest version (replica_health.py) and the manager
  asks weight-sync to deliver it (RequestSync, sync_link.py).
- External deployments (RegisterDeployment) are servers implementing InferenceEngineService,
  reached over gRPC.
- Every deployment registers with weight-sync (sync_link.py).
- A disaggregated deployment ([deployments.disaggregation]) is replicas like any other, each a
  whole CPU (or vLLM) engine; its first `prefill_workers` start as prefill workers, the others as
  decode workers (`ReplicaState.role`), which the router's two-phase request (two_phase.py) and a
  tuned split (split_tuning.py) use. Its workers are one weight-sync target.
- A replica whose engine reports itself broken (status engine["broken"]: a vLLM swap that failed
  after a rank loaded, or a prefix-cache reset that failed) is killed with restart
  (`recreate_replica`, asked by the router once per breakage), then resynced like any restart.
- A deployment that is removed (its run ended) leaves routing and its actors are killed for good.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from looprl.inference.v1 import inference_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.handles import GrpcReplicaHandle, RayReplicaHandle, ReplicaHandle
from services.inference_router.policies import (
    ROLE_DECODE,
    ROLE_PREFILL,
    DeploymentState,
    LengthProfile,
    ReplicaState,
)
from services.inference_router.router import Router
from services.inference_router.shared import SharedPool, shared_name
from services.inference_router.split_tuning import SplitTuning
from services.inference_router.sync_link import WeightSyncLink
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc import errors, tls
from services.kit.telemetry import tracing as telemetry

if TYPE_CHECKING:
    from services.kit.bus.client import Bus

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


def starting_role(spec: DeploymentSpec, index: int) -> str:
    """Replica `index`'s stage when a disaggregated deployment starts ("" when not disaggregated)."""
    if spec.disaggregation is None:
        return ""
    return ROLE_PREFILL if index < spec.disaggregation.prefill_workers else ROLE_DECODE


class DeploymentManager(WeightSyncLink):
    def __init__(self, router: Router, config: RouterConfig) -> None:
        self.router = router
        self.config = config
        self.specs: dict[str, DeploymentSpec] = {}
        self.actors: dict[str, Any] = {}
        self._weight_sync: Any = None
        self._every_k: dict[str, int] = {}
        self._where: dict[str, str] = {}  # deployment -> its place in the recipe, for errors
        self._bus: Bus | None = None
        self._subscription: Any = None
        self._registering: dict[str, asyncio.Task] = {}  # target -> its registration, tried again
        self.shared: dict[str, SharedPool] = {}  # shared deployment -> its actors and runs
        self._views: dict[str, str] = {}  # a run's view of a shared deployment -> the shared one

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
            adapter=run_id if spec.max_loras else "",
            disaggregated=spec.disaggregation is not None,
        )
        try:
            return await self._start(spec, state, ready_timeout_s, where)
        except BaseException:
            await self.remove(spec.name, [replica_name(spec.name, i) for i in range(spec.replicas)])
            raise

    async def _start(
        self, spec: DeploymentSpec, state: DeploymentState, ready_timeout_s: float, where: str
    ) -> DeploymentState:
        from services.inference_router.replica_actor import InferenceReplica

        handles: list[ReplicaHandle] = []
        pool = self._join_shared(spec, state, where) if spec.shared else None
        for index in range(spec.replicas):
            name = replica_name(spec.name, index)
            if pool is not None:  # a view of the shared replica: the actor is the pool's
                handles.append(RayReplicaHandle(name, pool.actors[index], adapter=state.adapter))
            else:
                actor = InferenceReplica.options(**replica_actor_options(spec, self.config, index)).remote(
                    spec=spec,
                    host=self.config.replica_host,
                    replica=name,
                    tracing=telemetry.exporter_settings(),
                    tls_credentials=tls.export(),
                )
                self.actors[name] = actor
                handles.append(RayReplicaHandle(name, actor, adapter=state.adapter))
            state.replicas.append(
                ReplicaState(
                    name=name,
                    deployment=spec.name,
                    max_outstanding_requests=spec.max_queued_requests,
                    role=starting_role(spec, index),
                )
            )
        await asyncio.gather(*(_await_alive(h, ready_timeout_s) for h in handles))
        self.router.add_deployment(state, handles)
        if spec.disaggregation is not None:
            self.router.splits[spec.name] = SplitTuning(spec.name, spec.disaggregation, spec.max_batch_size)
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

    def _join_shared(self, spec: DeploymentSpec, state: DeploymentState, where: str) -> SharedPool:
        """The shared replicas `spec` is a run's view of (created by the first run that names them)."""
        from services.inference_router.replica_actor import InferenceReplica

        name = shared_name(spec.name)
        pool = self.shared.get(name)
        if pool is None:
            base = spec.model_copy(update={"name": name})
            actors = [
                InferenceReplica.options(**replica_actor_options(base, self.config, index)).remote(
                    spec=base,
                    host=self.config.replica_host,
                    replica=replica_name(name, index),
                    tracing=telemetry.exporter_settings(),
                    tls_credentials=tls.export(),
                )
                for index in range(spec.replicas)
            ]
            pool = self.shared[name] = SharedPool(name, base, actors)
        pool.check_joins(spec.model_copy(update={"name": name}), state.run_id, where or "deployments")
        pool.runs.add(state.run_id)
        self._views[spec.name] = name
        return pool

    async def _leave_shared(self, view: str, run_id: str) -> None:
        """A run's view is gone: its adapter leaves the replicas; the last run frees them."""
        import ray

        pool = self.shared.get(self._views.pop(view, ""))
        if pool is None:
            return
        pool.runs.discard(run_id)
        if pool.runs:
            for actor in pool.actors:
                try:
                    await actor.drop_adapter.remote(run_id)
                except Exception as exc:  # a dead replica holds no adapter
                    log.warning("shared %s: dropping adapter %s: %s", pool.name, run_id, exc)
            return
        del self.shared[pool.name]
        for actor in pool.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.warning("could not kill shared replica of %s: %s", pool.name, exc)

    async def remove(self, name: str, replicas: list[str] | None = None) -> list[str]:
        """Take deployment `name` out of routing and kill its replica actors (without restart, so
        their Ray resources are free); returns its weight-sync targets. `replicas`: the actor names
        to kill when the deployment never reached the router (a failed start). A run's view of a
        shared deployment kills nothing while other runs share it."""
        import ray

        if name in self._views:
            state = await self.router.remove_deployment(name)
            run_id = state.run_id if state is not None else name.partition("/")[0]
            await self._leave_shared(name, run_id)
            self.specs.pop(name, None)
            self._every_k.pop(name, None)
            self._where.pop(name, None)
            return [r.name for r in state.replicas] if state is not None else list(replicas or [])
        state = await self.router.remove_deployment(name)
        if state is not None:
            replicas = [r.name for r in state.replicas]
        replicas = replicas or []
        targets = [name] if self._one_target(name) else list(replicas)
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

    async def stop(self) -> None:
        import ray

        for task in list(self._registering.values()):
            task.cancel()
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.warning("could not kill replica: %s", exc)
        self.actors.clear()
        for pool in self.shared.values():
            for actor in pool.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as exc:
                    log.warning("could not kill shared replica: %s", exc)
        self.shared.clear()
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


async def _await_alive(handle: ReplicaHandle, timeout_s: float) -> None:
    """The actor's constructor finished (it may still lack weights: status says ready=False)."""
    await handle.status(timeout_s)
