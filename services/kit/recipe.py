"""Run recipes: the TOML file a user writes to start a run, as typed, validated dataclasses.

Every field has a default and a docstring-like `help`. Parsing rejects unknown sections and
fields and names the offending path ("batch.group_size: ..."), so a bad recipe fails before
anything starts. Every number has bounds (`_BOUNDS`); the ones a cluster sets (rollouts per step,
world size, replicas, ...) come from `RecipeLimits`, which the gateway reads from its configuration.
The gateway stores the recipe text in the run record (KV bucket "runs"); every service re-parses it
with this module, so they all read the same run the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.kit.limits import INT32_MAX, INT64_MAX, RecipeLimits


class RecipeError(ValueError):
    """The recipe is invalid; the message names the field."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class RunSection:
    name: str = _f("run", "Human-readable run name; the run id is derived from it when not given.")
    seed: int = _f(0, "Seed for data generation, model init and sampling.")
    steps: int = _f(20, "Number of trainer steps (each publishes a new weight version).")
    max_staleness: int = _f(
        0, "Max trainer version minus sampling version; 0 = synchronous on-policy, k > 0 overlaps."
    )
    stall_seconds: float = _f(
        600.0,
        "A running run that trains no step, feeds no step and receives no weight version for this long is "
        "marked STALLED (with the last error a component reported); it is RUNNING again once it progresses. "
        "Leave room for the first step, which loads the model and starts every replica.",
    )


@dataclass
class ModelSection:
    path: str = _f("", "Local Hugging Face model directory; empty builds `preset` from a config.")
    preset: str = _f("tiny-qwen2", "Config preset used when path is empty.")
    tokenizer: str = _f("char", "'char' for the shipped character tokenizer, or a local tokenizer directory.")
    dtype: str = _f("float32", "Training and inference dtype (float32, bfloat16).")
    init_std: float = _f(
        0.02, "Std of the N(0, std) init of a preset model's weight matrices (0.1 suits tiny-qwen2)."
    )


@dataclass
class EnvironmentSection:
    name: str = _f("digits", "Registered environment name (digits, guess, code).")
    reward: str = _f("", "Registered reward name; empty uses the environment's default.")
    max_turns: int = _f(
        1,
        "Most model turns in one episode (multi-turn environments such as guess need more than 1); the "
        "Dr. GRPO constant normaliser is sampling.max_tokens times this.",
    )
    config: dict = _f({}, "Environment-specific settings (see the environment's config class).")


@dataclass
class SamplingSection:
    temperature: float = _f(1.0, "Sampling temperature (> 0 for RL).")
    top_p: float = _f(1.0, "Nucleus sampling mass.")
    top_k: int = _f(0, "Top-k truncation; 0 disables.")
    max_tokens: int = _f(16, "Maximum generated tokens per model turn.")


@dataclass
class BatchSection:
    rollouts_per_step: int = _f(64, "Rollouts per trainer step (the global batch); a multiple of group_size.")
    group_size: int = _f(8, "Samples per prompt (GRPO group).")
    max_tokens_per_microbatch: int = _f(4096, "Token budget of one packed micro-batch.")
    fork_groups: bool = _f(
        True,
        "One episode task per group that forks into group_size samples of the same prompt (one prefill, "
        "one request); false publishes one task per sample.",
    )


@dataclass
class AlgorithmSection:
    advantage: str = _f("grpo", "Advantage estimator: grpo, dr_grpo or rloo.")
    filter_equal_rewards: bool = _f(False, "Drop groups whose rewards are all equal (no signal).")
    loss_aggregation: str = _f("token-mean", "token-mean, seq-mean-token-mean or constant (Dr. GRPO).")
    clip_low: float = _f(0.2, "PPO clip range below 1.")
    clip_high: float = _f(0.28, "PPO clip range above 1 (clip-higher).")
    tis_cap: float = _f(2.0, "Cap of the truncated importance weight for stale rollouts.")
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the reference policy; 0 disables it.")
    entropy_coef: float = _f(
        0.0,
        "Entropy bonus weight, relative to the advantage scale (keeps small policies exploring); 0 disables.",
    )
    group_timeout_seconds: float = _f(120.0, "A group still incomplete after this is released as is.")


@dataclass
class OptimizerSection:
    lr: float = _f(1e-3, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    betas: list = _f([0.9, 0.99], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    schedule: str = _f("constant", "constant or cosine after warmup.")
    grad_clip: float = _f(1.0, "Gradient norm clip; 0 disables.")


@dataclass
class TrainerSection:
    world_size: int = _f(2, "Data-parallel trainer ranks (Ray actors, FSDP2).")
    checkpoint_every: int = _f(10, "Write a checkpoint every k steps (and on stop); 0 only on stop.")
    num_gpus_per_rank: float = _f(
        0.0, "GPUs each rank asks Ray for (1 on GPU nodes: the ranks then train with NCCL); 0 trains on CPU."
    )


@dataclass
class DeploymentSpec:
    name: str = _f("default", "Deployment name, unique in the run.")
    backend: str = _f("cpu", "Engine backend: cpu (embedded, torch) or vllm (GPU).")
    model_path: str = _f(
        "", "Local model directory; empty takes the architecture from the weights it is sent."
    )
    tensor_parallel: int = _f(
        1, "Tensor-parallel degree of each replica (a vLLM replica requests this many GPUs)."
    )
    dtype: str = _f(
        "",
        "Weights and compute dtype (float32, bfloat16, float16); empty: bfloat16 for vllm, float32 for cpu.",
    )
    gpu_memory_utilization: float = _f(
        0.0,
        "vllm: share of each GPU's memory a replica takes; 0 takes vLLM's default (0.85). Below 1 a tp=1 "
        "replica asks Ray for that fraction of a GPU, so several share one.",
    )
    pause_mode: str = _f(
        "keep",
        "vllm: what in-flight requests do during a weight swap: keep (frozen, resumed after it) or abort "
        "(aborted, each completion then continues as a new request).",
    )
    replicas: int = _f(1, "Number of replicas.")
    max_model_len: int = _f(512, "Longest prompt + completion a replica accepts.")
    max_batch_size: int = _f(32, "Most sequences decoded together.")
    max_queued_requests: int = _f(256, "Queue bound per replica before RESOURCE_EXHAUSTED.")
    min_prompt_tokens: int = _f(0, "Length profile: shortest prompt this deployment is tuned for.")
    max_prompt_tokens: int = _f(1 << 30, "Length profile: longest prompt.")
    min_output_tokens: int = _f(0, "Length profile: shortest expected output.")
    max_output_tokens: int = _f(1 << 30, "Length profile: longest expected output.")
    sync_every: int = _f(1, "Receive every k-th weight version.")
    weight_transport: str = _f(
        "auto",
        "How weight-sync delivers weights to this deployment's replicas: auto (shared memory to "
        "co-located replicas, gRPC to the others), grpc, shm, shared_copy, cuda_ipc or nccl.",
    )
    canary: bool = _f(
        False,
        "Canary weight updates: a new version serves on the first replica only until its greedy "
        "log-probs on golden prompts drift within canary_max_logprob_drift of the version before; "
        "otherwise it is rolled back there and never reaches the other replicas.",
    )
    canary_max_logprob_drift: float = _f(
        0.0, "Largest accepted mean |log-prob change| (nats) of the canary check; 0: weight-sync's default."
    )
    canary_tokens_per_prompt: int = _f(0, "Greedy tokens per golden prompt in the canary check; 0: default.")


@dataclass
class Recipe:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    batch: BatchSection = field(default_factory=BatchSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    deployments: list[DeploymentSpec] = field(default_factory=lambda: [DeploymentSpec()])

    @property
    def groups_per_step(self) -> int:
        return self.batch.rollouts_per_step // self.batch.group_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecipeError(f"{_join(where, unknown[0])}: unknown field (known: {', '.join(sorted(known))})")
    values = {}
    for name, raw in data.items():
        tp = hints[name]
        path = _join(where, name)
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw, path)
        elif (
            typing.get_origin(tp) is list
            and typing.get_args(tp)
            and dataclasses.is_dataclass(typing.get_args(tp)[0])
        ):
            if not isinstance(raw, list):
                raise RecipeError(f"{path}: expected an array of tables")
            values[name] = [
                _build(typing.get_args(tp)[0], item, f"{path}[{i}]") for i, item in enumerate(raw)
            ]
        else:
            values[name] = _coerce(raw, tp, path)
    return cls(**values)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _coerce(raw: Any, tp: Any, path: str) -> Any:
    base = typing.get_origin(tp) or tp
    if base is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if base is bool and not isinstance(raw, bool):
        raise RecipeError(f"{path}: expected true or false, got {raw!r}")
    if base is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise RecipeError(f"{path}: expected an integer, got {raw!r}")
    if not isinstance(raw, base):
        raise RecipeError(f"{path}: expected {base.__name__}, got {type(raw).__name__} {raw!r}")
    return raw


@dataclass(frozen=True)
class _Above:
    """An exclusive lower bound (the value must be greater)."""

    value: float


# Bounds of every number in a recipe by field path (`name[]`: each element of a list):
# (smallest, largest), inclusive; a str largest names the RecipeLimits field that holds it.
# Floats must also be finite (TOML has inf and nan).
_BOUNDS: dict[str, tuple[float | _Above, float | str]] = {
    "run.seed": (0, INT64_MAX),
    "run.steps": (1, "max_steps"),
    "run.max_staleness": (0, "max_staleness"),
    "run.stall_seconds": (1.0, 7 * 86_400.0),
    "model.init_std": (_Above(0.0), 10.0),
    "environment.max_turns": (1, 1024),
    "sampling.temperature": (_Above(0.0), 100.0),
    "sampling.top_p": (_Above(0.0), 1.0),
    "sampling.top_k": (0, INT32_MAX),
    "sampling.max_tokens": (1, "max_tokens"),
    "batch.rollouts_per_step": (1, "max_rollouts_per_step"),
    "batch.group_size": (1, "max_group_size"),
    "batch.max_tokens_per_microbatch": (1, "max_tokens_per_microbatch"),
    "algorithm.clip_low": (0.0, 1.0),
    "algorithm.clip_high": (0.0, 100.0),
    "algorithm.tis_cap": (0.0, 1e6),
    "algorithm.kl_coef": (0.0, 1e6),
    "algorithm.entropy_coef": (0.0, 1e6),
    "algorithm.group_timeout_seconds": (_Above(0.0), 7 * 86_400.0),
    "optimizer.lr": (_Above(0.0), 1.0),
    "optimizer.weight_decay": (0.0, 1e3),
    "optimizer.betas[]": (0.0, 1.0),
    "optimizer.eps": (_Above(0.0), 1.0),
    "optimizer.warmup_steps": (0, "max_steps"),
    "optimizer.grad_clip": (0.0, 1e9),
    "trainer.world_size": (1, "max_world_size"),
    "trainer.checkpoint_every": (0, "max_steps"),
    "trainer.num_gpus_per_rank": (0.0, 64.0),
    "deployments[].tensor_parallel": (1, "max_tensor_parallel"),
    "deployments[].gpu_memory_utilization": (0.0, 1.0),
    "deployments[].replicas": (1, "max_replicas"),
    "deployments[].max_model_len": (1, "max_model_len"),
    "deployments[].max_batch_size": (1, "max_batch_size"),
    "deployments[].max_queued_requests": (1, "max_queued_requests"),
    "deployments[].min_prompt_tokens": (0, INT32_MAX),
    "deployments[].max_prompt_tokens": (0, INT32_MAX),
    "deployments[].min_output_tokens": (0, INT32_MAX),
    "deployments[].max_output_tokens": (0, INT32_MAX),
    "deployments[].sync_every": (1, "max_steps"),
    "deployments[].canary_max_logprob_drift": (0.0, 1e6),
    "deployments[].canary_tokens_per_prompt": (0, "max_tokens"),
}


def _values_at(node: Any, path: list[str], where: str) -> list[tuple[str, Any]]:
    """(dotted path, value) of every value the bounds path names (expanding `name[]` lists)."""
    if not path:
        return [(where, node)]
    name, rest = path[0], path[1:]
    if name.endswith("[]"):
        items = getattr(node, name[:-2])
        found = []
        for i, item in enumerate(items):
            found.extend(_values_at(item, rest, f"{_join(where, name[:-2])}[{i}]"))
        return found
    return _values_at(getattr(node, name), rest, _join(where, name))


def _check_bounds(recipe: Recipe, limits: RecipeLimits) -> None:
    for field_path, (low, high) in _BOUNDS.items():
        for path, value in _values_at(recipe, field_path.split("."), ""):
            if isinstance(value, float) and not math.isfinite(value):
                raise RecipeError(f"{path}: must be a finite number, got {value}")
            if isinstance(low, _Above):
                _check(value > low.value, path, f"must be > {low.value}, got {value}")
            else:
                _check(value >= low, path, f"must be >= {low}, got {value}")
            if isinstance(high, str):
                limit = getattr(limits, high)
                _check(value <= limit, path, f"must be <= {limit} (this cluster's {high}), got {value}")
            else:
                _check(value <= high, path, f"must be <= {high}, got {value}")


def _check_finite(node: Any, where: str) -> None:
    """Every float anywhere in the recipe, free-form tables (environment.config) included, is finite:
    TOML spells inf and nan, and one NaN hyper-parameter turns every weight into NaN."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_finite(getattr(node, f.name), _join(where, f.name))
    elif isinstance(node, dict):
        for key, value in node.items():
            _check_finite(value, _join(where, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_finite(value, f"{where}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise RecipeError(f"{where}: must be a finite number, got {node}")


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise RecipeError(f"{path}: {message}")


# A tokenizer directory holds one of these: a Hugging Face tokenizer, or the char tokenizer's marker.
TOKENIZER_FILES = ("tokenizer.json", "looprl_tokenizer.json")


def _local_dir(value: str, base_dir: Path | None) -> Path:
    """A recipe's local directory: services open it from their working directory; a recipe file may
    also name it relative to itself."""
    path = Path(value)
    if not path.is_absolute() and base_dir is not None and not path.is_dir():
        path = base_dir / path
    return path


def validate(recipe: Recipe, base_dir: Path | None = None, limits: RecipeLimits | None = None) -> Recipe:
    """Bounds (against `limits`, the defaults when None) and cross-field checks; raises RecipeError
    naming the first bad field."""
    r = recipe
    limits = limits or RecipeLimits()
    _check_finite(r, "")
    _check_bounds(r, limits)
    _check(bool(r.run.name.strip()), "run.name", "must not be empty")
    _check(
        "max_turns" not in r.environment.config,
        "environment.config.max_turns",
        "set environment.max_turns instead (the trainer's Dr. GRPO normaliser reads it too)",
    )
    if r.model.path:
        path = _local_dir(r.model.path, base_dir)
        _check(path.is_dir(), "model.path", f"directory {str(path)!r} does not exist")
        _check((path / "config.json").exists(), "model.path", f"{str(path)!r} has no config.json")
    if r.model.tokenizer != "char":
        path = _local_dir(r.model.tokenizer, base_dir)
        _check(
            path.is_dir(),
            "model.tokenizer",
            f"must be 'char' or a local tokenizer directory; {str(path)!r} does not exist",
        )
        _check(
            any((path / name).is_file() for name in TOKENIZER_FILES),
            "model.tokenizer",
            f"{str(path)!r} has none of {', '.join(TOKENIZER_FILES)}",
        )
    else:
        _check(
            r.model.preset in MODEL_PRESETS,
            "model.preset",
            f"unknown preset {r.model.preset!r} (known: {', '.join(MODEL_PRESETS)})",
        )
    _check(
        r.model.dtype in ("float32", "bfloat16"),
        "model.dtype",
        f"must be float32 or bfloat16, got {r.model.dtype!r}",
    )
    _check(
        r.batch.rollouts_per_step % r.batch.group_size == 0,
        "batch.rollouts_per_step",
        f"{r.batch.rollouts_per_step} is not divisible by batch.group_size {r.batch.group_size}",
    )
    _check(
        r.algorithm.advantage in ("grpo", "dr_grpo", "rloo"),
        "algorithm.advantage",
        f"unknown estimator {r.algorithm.advantage!r} (grpo, dr_grpo, rloo)",
    )
    _check(
        r.algorithm.loss_aggregation in ("token-mean", "seq-mean-token-mean", "constant"),
        "algorithm.loss_aggregation",
        f"unknown aggregation {r.algorithm.loss_aggregation!r}",
    )
    _check(
        r.algorithm.advantage != "rloo" or r.batch.group_size > 1,
        "batch.group_size",
        "rloo needs group_size > 1",
    )
    _check(len(r.optimizer.betas) == 2, "optimizer.betas", "must have two values")
    _check(
        r.optimizer.schedule in ("constant", "cosine"),
        "optimizer.schedule",
        f"unknown schedule {r.optimizer.schedule!r}",
    )
    _check(len(r.deployments) > 0, "deployments", "at least one deployment is needed")
    _check(
        len(r.deployments) <= limits.max_deployments,
        "deployments",
        f"must be at most {limits.max_deployments} (this cluster's max_deployments), got {len(r.deployments)}",
    )
    names = set()
    for i, d in enumerate(r.deployments):
        where = f"deployments[{i}]"
        _check(d.name not in names, f"{where}.name", f"duplicate deployment name {d.name!r}")
        names.add(d.name)
        _check(d.backend in ("cpu", "vllm"), f"{where}.backend", f"unknown backend {d.backend!r} (cpu, vllm)")
        _check(
            d.dtype in ("", "float32", "bfloat16", "float16"),
            f"{where}.dtype",
            f"must be float32, bfloat16 or float16 (empty: the backend's default), got {d.dtype!r}",
        )
        _check(
            d.gpu_memory_utilization < 1.0,
            f"{where}.gpu_memory_utilization",
            f"must be in [0, 1) (0: vLLM's default), got {d.gpu_memory_utilization}",
        )
        _check(
            d.pause_mode in ("keep", "abort"), f"{where}.pause_mode", f"keep or abort, got {d.pause_mode!r}"
        )
        _check(
            d.weight_transport in WEIGHT_TRANSPORTS,
            f"{where}.weight_transport",
            f"unknown transport {d.weight_transport!r} ({', '.join(WEIGHT_TRANSPORTS)})",
        )
        _check(
            d.min_prompt_tokens <= d.max_prompt_tokens,
            f"{where}.max_prompt_tokens",
            "must be >= min_prompt_tokens",
        )
        _check(
            d.min_output_tokens <= d.max_output_tokens,
            f"{where}.max_output_tokens",
            "must be >= min_output_tokens",
        )
    return r


def sampling_seed(run_seed: int, task_index: int, sample: int = 0) -> int:
    """The seed of sample `sample` of the run's `task_index`-th task: never 0 (0 means unseeded), the
    same in every process, so a run's samples depend on its seed alone. An n-completion request
    seeded s samples completion i with s + i (the engines' convention)."""
    return (run_seed * 1_000_003 + task_index * 1009 + sample) % (2**62) + 1


# How weight-sync may reach a deployment's replicas (see DeploymentSpec.weight_transport).
WEIGHT_TRANSPORTS = ("auto", "grpc", "shm", "shared_copy", "cuda_ipc", "nccl")

# Names of the model configs a recipe can build without a download (see services/modeling).
MODEL_PRESETS = ("tiny-qwen2", "small-qwen2")


def parse_recipe(text: str, base_dir: Path | None = None, limits: RecipeLimits | None = None) -> Recipe:
    """Parse and validate recipe TOML text (against `limits`, the defaults when None)."""
    limits = limits or RecipeLimits()
    size = len(text.encode())
    if size > limits.max_recipe_bytes:
        raise RecipeError(
            f"recipe: {size} bytes, more than this cluster's max_recipe_bytes ({limits.max_recipe_bytes})"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"recipe: not valid TOML: {exc}") from exc
    if "deployments" in data and isinstance(data["deployments"], dict):
        raise RecipeError("deployments: use [[deployments]] (an array of tables)")
    return validate(_build(Recipe, data, ""), base_dir, limits)


def load_recipe(path: str | Path, limits: RecipeLimits | None = None) -> Recipe:
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe: file {str(path)!r} does not exist")
    return parse_recipe(path.read_text(), base_dir=path.parent, limits=limits)


@dataclass
class RunRecord:
    """A run as stored by the gateway in the KV bucket "runs" (key: run id), JSON-encoded."""

    run_id: str
    recipe_toml: str
    state: str = "pending"  # pending, running, stopping, completed, failed, stopped
    created_at: float = 0.0
    step: int = 0
    weight_version: int = 0
    error: str = ""
    episodes_published: int = 0
    extra: dict = field(default_factory=dict)

    def recipe(self) -> Recipe:
        # The gateway admitted the recipe against its own limits; every reader takes it as admitted.
        return parse_recipe(self.recipe_toml, limits=RecipeLimits.ceilings())

    def to_json(self) -> bytes:
        # Not dataclasses.asdict, which deep-copies `extra` first: the gateway writes the record
        # several times a step.
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RunRecord:
        data = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
