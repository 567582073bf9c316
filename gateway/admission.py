"""Admission of a run's prerequisites: what must exist on this stack before a run record is written.

A run's demand on the cluster (`run_demand`: its trainer ranks' and inference replicas' Ray CPUs,
GPUs and custom resources) is held against its tenant's per-run quota (`check_quota`) and the
cluster's total resources (`check_cluster`): over either, the run can never fit and CreateRun is
RESOURCE_EXHAUSTED naming the resource and the numbers, before the run exists. A run that fits
but not now (its tenant at max_concurrent_runs, `concurrency_reason`, or too few free resources)
waits in the run queue (gateway/queue.py).

A recipe can be valid on its own and still be unable to make progress here: no deployment of the
inference-router serves it (or none holds a prompt and a turn of sampling.max_tokens), the
environment-sandbox does not know its environment, the reward
service does not know its reward, or its tokenizer's vocabulary does not fit the model's. Each
is refused with FAILED_PRECONDITION naming the recipe field and what is missing, before the run
exists. The services are asked over their own RPCs (ListDeployments here; LoadEnvironment and
LoadReward, which also load and check user code, in gateway/task_code.py); a service whose address
the gateway was not given is not asked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import Tenant
from looprl.environment.v1 import environment_pb2_grpc
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.reward.v1 import reward_pb2_grpc
from services.kit.config.recipe import Recipe, unservable_max_tokens
from services.kit.rpc.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger("looprl.gateway.admission")

# Hugging Face models pad their embedding past the tokenizer (Qwen2.5: 151,936 rows for 151,665
# ids), so a model vocabulary somewhat larger than the tokenizer's is normal; much larger means
# the policy samples ids the tokenizer cannot decode.
VOCAB_PADDING_TOLERANCE = 512


@dataclass
class Peers:
    """Stubs of the services admission asks; None where the gateway has no address for one. `health`
    holds the health stubs of the services a run needs (by name), for the stall watch to name one
    that is not serving."""

    router: inference_pb2_grpc.InferenceRouterServiceStub | None = None
    sandbox: environment_pb2_grpc.EnvironmentSandboxServiceStub | None = None
    reward: reward_pb2_grpc.RewardServiceStub | None = None
    timeout_s: float = 10.0
    health: dict[str, health_pb2_grpc.HealthStub] = field(default_factory=dict)

    async def not_serving(self) -> list[str]:
        """'<service> (<status>)' for each service whose health check does not answer SERVING."""
        out = []
        for name, stub in sorted(self.health.items()):
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                status = f"DOWN: {exc.code().name}"
            if status != "SERVING":
                out.append(f"{name} ({status})")
        return out


@dataclass(frozen=True)
class Part:
    """What one part of a run asks Ray for, and how that follows from the recipe (for messages)."""

    name: str  # "trainer", "deployments[0] 'default'"
    cpus: float
    gpus: float
    cpus_how: str
    gpus_how: str
    custom: Mapping[str, float] = field(default_factory=dict)  # custom Ray resources, by name
    # A deployment shared by LoRA runs (`shared = true`): its replicas are held once, whichever runs
    # use them (this key), and each run takes one of its adapter slots (`slots`: the capacity of
    # the virtual resource LORA_SLOTS + name, its max_loras).
    shared: str = ""
    slots: Mapping[str, float] = field(default_factory=dict)

    def amount(self, resource: str) -> float:
        """What this part asks of one Ray resource ("CPU", "GPU" or a custom one)."""
        if resource == "CPU":
            return self.cpus
        if resource == "GPU":
            return self.gpus
        return self.custom.get(resource, 0.0)


@dataclass(frozen=True)
class Demand:
    """A run's Ray resources: its trainer ranks and every deployment's replicas."""

    parts: tuple[Part, ...]

    def resources(self, held_shared: frozenset[str] = frozenset()) -> dict[str, float]:
        """Every Ray resource the run asks for, by Ray's name ("CPU", "GPU", custom ones), amounts > 0;
        the replicas of a shared deployment in `held_shared` are held already (its adapter slot is
        still asked for)."""
        names = ["CPU", "GPU", *sorted({n for p in self.parts for n in p.custom})]
        out = {
            n: sum(
                p.amount(n)
                for p in self.parts
                if not (p.shared in held_shared and p.shared and n not in p.slots)
            )
            for n in names
        }
        return {n: v for n, v in out.items() if v > 0}

    def capacities(self) -> dict[str, float]:
        """The adapter slots of the shared deployments the run names (virtual resources)."""
        return {name: cap for p in self.parts for name, cap in p.slots.items()}

    @property
    def shared(self) -> frozenset[str]:
        return frozenset(p.shared for p in self.parts if p.shared)

    def without_deployments(self) -> Demand:
        """The trainer's part only: for a run served by deployments the router already runs."""
        return Demand(tuple(p for p in self.parts if p.name == "trainer"))

    @property
    def cpus(self) -> float:
        return sum(p.cpus for p in self.parts)

    @property
    def gpus(self) -> float:
        return sum(p.gpus for p in self.parts)


# The adapter slots of a shared deployment, counted like a Ray resource of max_loras units.
LORA_SLOTS = "lora-slots:"


def _n(value: float) -> str:
    """A count as people write it: 8, 0.5, 1.25."""
    return f"{value:g}"


def run_demand(recipe: Recipe) -> Demand:
    """The CPUs and GPUs `recipe` asks Ray for: world_size trainer ranks of trainer.num_cpus_per_rank CPUs
    and trainer.num_gpus_per_rank GPUs each, and per deployment `replicas` replicas of
    DeploymentSpec.cpus_per_replica / gpus_per_replica (what the inference-router's replica actors ask)."""
    t = recipe.trainer
    parts = [
        Part(
            "trainer",
            t.world_size * t.num_cpus_per_rank,
            t.world_size * t.num_gpus_per_rank,
            f"world_size {t.world_size} x num_cpus_per_rank {t.num_cpus_per_rank!r}",
            f"world_size {t.world_size} x num_gpus_per_rank {t.num_gpus_per_rank!r}",
            {name: t.world_size * amount for name, amount in t.ray_resources_per_rank.items()},
        )
    ]
    for i, d in enumerate(recipe.deployments):
        per_cpus, per_gpus = d.cpus_per_replica, d.gpus_per_replica
        cpus_how = f"replicas {d.replicas} x {_n(per_cpus)} CPUs (num_cpus {d.num_cpus!r}"
        cpus_how += f" + {d.tensor_parallel - 1} tensor-parallel workers)" if per_cpus != d.num_cpus else ")"
        if d.backend == "vllm" and d.tensor_parallel == 1 and d.gpu_memory_utilization > 0:
            gpus_how = f"replicas {d.replicas} x gpu_memory_utilization {d.gpu_memory_utilization!r}, vllm"
        else:
            gpus_how = f"replicas {d.replicas} x tensor_parallel {d.tensor_parallel}, {d.backend}"
        custom = {name: d.replicas * amount for name, amount in d.ray_resources.items()}
        slots: dict[str, float] = {}
        if d.shared:
            custom[LORA_SLOTS + d.name] = 1.0
            slots[LORA_SLOTS + d.name] = float(d.max_loras)
        parts.append(
            Part(
                f"deployments[{i}] {d.name!r}",
                d.replicas * per_cpus,
                d.replicas * per_gpus,
                cpus_how,
                gpus_how,
                custom,
                shared=d.name if d.shared else "",
                slots=slots,
            )
        )
    return Demand(tuple(parts))


def check_quota(demand: Demand, tenant: Tenant) -> None:
    """ResourceExhausted when the run asks for more GPUs or CPUs than the tenant's quota allows: naming
    the part that alone exceeds it, else the whole run with its parts."""
    for resource, unit, limit in (("gpus", "GPUs", tenant.max_gpus), ("cpus", "CPUs", tenant.max_cpus)):
        total = getattr(demand, resource)
        if total <= limit + 1e-9:
            continue
        quota = f"exceed tenant {tenant.name!r} quota max_{resource}={_n(limit)}"
        for part in demand.parts:
            amount = getattr(part, resource)
            if amount > limit + 1e-9:
                how = getattr(part, f"{resource}_how")
                raise ResourceExhausted(f"{part.name}: {_n(amount)} {unit} ({how}) {quota}")
        parts = " + ".join(
            f"{p.name} {_n(getattr(p, resource))}" for p in demand.parts if getattr(p, resource)
        )
        raise ResourceExhausted(f"run: {_n(total)} {unit} ({parts}) {quota}")


def check_cluster(demand: Demand, total: Mapping[str, float]) -> None:
    """ResourceExhausted when the run asks for more of a Ray resource than the whole cluster has
    (`total`: every alive node's resources): it could never start."""
    total = {**total, **demand.capacities()}
    for resource, amount in demand.resources().items():
        have = total.get(resource, 0.0)
        if amount <= have + 1e-9:
            continue
        parts = " + ".join(f"{p.name} {_n(p.amount(resource))}" for p in demand.parts if p.amount(resource))
        raise ResourceExhausted(
            f"run: needs {_n(amount)} {resource} ({parts}), more than the cluster's total "
            f"{resource}={_n(have)}: it could never start"
        )


def concurrency_reason(tenant: Tenant, active_runs: int) -> str:
    """Why a run of `tenant` must wait for one of its `active_runs` to end, or "" when it need not."""
    if active_runs < tenant.max_concurrent_runs:
        return ""
    return (
        f"max_concurrent_runs: tenant {tenant.name!r} has {active_runs} active runs, its quota "
        f"max_concurrent_runs={tenant.max_concurrent_runs}"
    )


async def admit(recipe: Recipe, peers: Peers, base_dir: Path) -> bool:
    """Raise FailedPrecondition naming the first missing prerequisite of `recipe`. Returns whether
    the run would be served by the router's configured deployments, shared by every run of the stack,
    rather than by deployments of its own."""
    check_vocabulary(recipe, base_dir)
    shared = False
    if peers.router is not None:
        shared = await _check_deployments(recipe, peers)
    return shared


async def _ask(service: str, call, request, timeout_s: float):
    try:
        return await call(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise FailedPrecondition(
            f"{service} cannot be asked whether it serves this run: {exc.code().name}: {exc.details()}"
        ) from None


async def _check_deployments(recipe: Recipe, peers: Peers) -> bool:
    reply = await _ask(
        "inference-router",
        peers.router.ListDeployments,
        inference_pb2.ListDeploymentsRequest(),
        peers.timeout_s,
    )
    if reply.starts_run_deployments:
        return False  # the run brings its own deployments: the router starts them when the run starts
    served = sorted(d.name for d in reply.deployments if d.replicas)
    wanted = [d.name for d in recipe.deployments]
    if not any(name in served for name in wanted):
        have = ", ".join(served) if served else "none"
        raise FailedPrecondition(
            f"deployments: no deployment serves this run: the recipe asks for {', '.join(wanted)}; the "
            f"inference-router serves {have} (it serves only its configured deployments)"
        )
    # The run's requests go to any of the stack's deployments: one of them must hold a prompt and
    # a turn of sampling.max_tokens. A router that leaves max_model_len unset (0: a router of the
    # user's own, say) reports no length, so only the lengths reported are held to it.
    reported = [d.max_model_len for d in reply.deployments if d.replicas and d.max_model_len > 0]
    longest = max(reported, default=0)
    if reported and recipe.sampling.max_tokens >= longest:
        raise FailedPrecondition(
            "sampling.max_tokens: "
            + unservable_max_tokens(recipe.sampling.max_tokens, longest)
            + " (the inference-router's configured deployments)"
        )
    return True


def model_vocab_size(recipe: Recipe, base_dir: Path) -> int:
    """Rows of the run's model's embedding: its config.json's vocab_size, or its preset's."""
    from services.modeling.config import model_preset

    if not recipe.model.path:
        return model_preset(recipe.model.preset).vocab_size
    path = Path(recipe.model.path)
    if not path.is_absolute() and not path.is_dir():
        path = base_dir / path
    try:
        return int(json.loads((path / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FailedPrecondition(
            f"model.path: cannot read vocab_size from {recipe.model.path!r}'s config.json: {exc}"
        ) from None


def check_vocabulary(recipe: Recipe, base_dir: Path) -> None:
    """The tokenizer's ids must all index the model's embedding, and the model must not sample many
    ids the tokenizer cannot decode."""
    from services.modeling.tokenizer import load_tokenizer

    spec = recipe.model.tokenizer
    if spec != "char" and not Path(spec).is_absolute() and not Path(spec).is_dir():
        spec = str(base_dir / spec)
    try:
        tokenizer_vocab = load_tokenizer(spec).vocab_size
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(
            f"model.tokenizer: {recipe.model.tokenizer!r} does not load: {exc}"
        ) from None
    model_vocab = model_vocab_size(recipe, base_dir)
    model = recipe.model.path or f"preset {recipe.model.preset!r}"
    if tokenizer_vocab > model_vocab:
        raise FailedPrecondition(
            f"model.tokenizer: vocabulary mismatch: the tokenizer {recipe.model.tokenizer!r} has "
            f"{tokenizer_vocab} ids, the model ({model}) has vocab_size {model_vocab}: ids past "
            f"{model_vocab - 1} have no embedding"
        )
    if model_vocab - tokenizer_vocab > VOCAB_PADDING_TOLERANCE:
        raise FailedPrecondition(
            f"model.tokenizer: vocabulary mismatch: the model ({model}) has vocab_size {model_vocab}, the "
            f"tokenizer {recipe.model.tokenizer!r} only {tokenizer_vocab} ids: the policy would sample "
            "ids the tokenizer cannot decode (is this the model's own tokenizer?)"
        )
