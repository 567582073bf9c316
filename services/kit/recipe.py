"""Run recipes: the TOML file a user writes to start a run, as typed, validated dataclasses.

Every field has a default and a docstring-like `help`. Parsing rejects unknown sections and
fields and names the offending path ("batch.group_size: ..."), so a bad recipe fails before
anything starts. The gateway stores the recipe text in the run record (KV bucket "runs");
every service re-parses it with this module, so they all read the same run the same way.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise RecipeError(f"{path}: {message}")


def validate(recipe: Recipe, base_dir: Path | None = None) -> Recipe:
    """Cross-field checks; raises RecipeError naming the first bad field."""
    r = recipe
    _check(r.run.steps > 0, "run.steps", f"must be > 0, got {r.run.steps}")
    _check(r.run.max_staleness >= 0, "run.max_staleness", f"must be >= 0, got {r.run.max_staleness}")
    _check(bool(r.run.name.strip()), "run.name", "must not be empty")
    if r.model.path:
        path = Path(r.model.path)
        if not path.is_absolute() and base_dir is not None and not path.is_dir():
            # Services open the path from their working directory; a recipe file may also name it
            # relative to itself.
            path = base_dir / path
        _check(path.is_dir(), "model.path", f"directory {str(path)!r} does not exist")
        _check((path / "config.json").exists(), "model.path", f"{str(path)!r} has no config.json")
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
        r.sampling.temperature > 0,
        "sampling.temperature",
        f"must be > 0 for RL sampling, got {r.sampling.temperature}",
    )
    _check(0 < r.sampling.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {r.sampling.top_p}")
    _check(r.sampling.max_tokens > 0, "sampling.max_tokens", f"must be > 0, got {r.sampling.max_tokens}")
    _check(r.batch.group_size > 0, "batch.group_size", f"must be > 0, got {r.batch.group_size}")
    _check(
        r.batch.rollouts_per_step > 0,
        "batch.rollouts_per_step",
        f"must be > 0, got {r.batch.rollouts_per_step}",
    )
    _check(
        r.batch.rollouts_per_step % r.batch.group_size == 0,
        "batch.rollouts_per_step",
        f"{r.batch.rollouts_per_step} is not divisible by batch.group_size {r.batch.group_size}",
    )
    _check(r.batch.max_tokens_per_microbatch > 0, "batch.max_tokens_per_microbatch", "must be > 0")
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
    _check(r.optimizer.lr > 0, "optimizer.lr", f"must be > 0, got {r.optimizer.lr}")
    _check(r.model.init_std > 0, "model.init_std", f"must be > 0, got {r.model.init_std}")
    _check(
        r.algorithm.entropy_coef >= 0,
        "algorithm.entropy_coef",
        f"must be >= 0, got {r.algorithm.entropy_coef}",
    )
    _check(len(r.optimizer.betas) == 2, "optimizer.betas", "must have two values")
    _check(
        r.optimizer.schedule in ("constant", "cosine"),
        "optimizer.schedule",
        f"unknown schedule {r.optimizer.schedule!r}",
    )
    _check(r.trainer.world_size > 0, "trainer.world_size", f"must be > 0, got {r.trainer.world_size}")
    _check(len(r.deployments) > 0, "deployments", "at least one deployment is needed")
    names = set()
    for i, d in enumerate(r.deployments):
        where = f"deployments[{i}]"
        _check(d.name not in names, f"{where}.name", f"duplicate deployment name {d.name!r}")
        names.add(d.name)
        _check(d.backend in ("cpu", "vllm"), f"{where}.backend", f"unknown backend {d.backend!r} (cpu, vllm)")
        _check(d.tensor_parallel > 0, f"{where}.tensor_parallel", "must be > 0")
        _check(
            d.dtype in ("", "float32", "bfloat16", "float16"),
            f"{where}.dtype",
            f"must be float32, bfloat16 or float16 (empty: the backend's default), got {d.dtype!r}",
        )
        _check(
            0.0 <= d.gpu_memory_utilization < 1.0,  # also rejects NaN
            f"{where}.gpu_memory_utilization",
            f"must be in [0, 1) (0: vLLM's default), got {d.gpu_memory_utilization}",
        )
        _check(
            d.pause_mode in ("keep", "abort"), f"{where}.pause_mode", f"keep or abort, got {d.pause_mode!r}"
        )
        _check(d.replicas > 0, f"{where}.replicas", "must be > 0")
        _check(d.sync_every > 0, f"{where}.sync_every", "must be > 0")
        _check(
            d.canary_max_logprob_drift >= 0,  # also rejects NaN
            f"{where}.canary_max_logprob_drift",
            "must be >= 0",
        )
        _check(d.canary_tokens_per_prompt >= 0, f"{where}.canary_tokens_per_prompt", "must be >= 0")
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


# Names of the model configs a recipe can build without a download (see services/modeling).
MODEL_PRESETS = ("tiny-qwen2", "small-qwen2")


def parse_recipe(text: str, base_dir: Path | None = None) -> Recipe:
    """Parse and validate recipe TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"recipe: not valid TOML: {exc}") from exc
    if "deployments" in data and isinstance(data["deployments"], dict):
        raise RecipeError("deployments: use [[deployments]] (an array of tables)")
    return validate(_build(Recipe, data, ""), base_dir)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe: file {str(path)!r} does not exist")
    return parse_recipe(path.read_text(), base_dir=path.parent)


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
        return parse_recipe(self.recipe_toml)

    def to_json(self) -> bytes:
        # Not dataclasses.asdict, which deep-copies `extra` first: the gateway writes the record
        # several times a step.
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RunRecord:
        data = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
