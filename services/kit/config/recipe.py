"""Run recipes: the TOML file a user writes to start a run, as one typed, validated schema.

Each section is a pydantic model (services/kit/config/schema.py): a field's type, default, bounds and
docstring sit together, and the components take their section as is. Parsing rejects unknown
sections and fields and names the offending path and what is allowed ("batch.group_size: ..."), so a
bad recipe fails before anything starts. Every number has bounds; the ones a cluster sets (rollouts
per step, world size, replicas, ...) are `AtMost` a `RecipeLimits` field, which the gateway reads
from its configuration. The gateway stores the recipe text in the run record (KV bucket "runs");
every service re-parses it with this module, so they all read the same run the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, GetCoreSchemaHandler, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError, core_schema

from services.kit.config.limits import INT32_MAX, INT64_MAX, RecipeLimits
from services.kit.config.schema import Schema, field_error, parse

if TYPE_CHECKING:
    from services.modeling.config import ModelConfig


class RecipeError(ValueError):
    """The recipe is invalid; the message names the field."""


@dataclass(frozen=True)
class AtMost:
    """A bound set by the cluster: the value may be at most the `limit` field of the RecipeLimits the
    recipe is validated against (the gateway's; the defaults when none is given)."""

    limit: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any, info: ValidationInfo) -> Any:
        limits = (info.context or {}).get("limits") or _DEFAULT_LIMITS
        bound = getattr(limits, self.limit)
        if value > bound:
            raise PydanticCustomError(
                "cluster_limit",
                "must be <= {bound} (this cluster's {limit}), got {value}",
                {"bound": bound, "limit": self.limit, "value": value},
            )
        return value

    def describe_bound(self) -> str:
        return f"<= the cluster's {self.limit}"


_DEFAULT_LIMITS = RecipeLimits()
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seconds = Annotated[float, Field(gt=0.0, le=7 * 86_400.0)]

# How weight-sync may reach a deployment's replicas (see DeploymentSpec.weight_transport).
WeightTransport = Literal["auto", "grpc", "shm", "shared_copy", "cuda_ipc", "nccl"]
WEIGHT_TRANSPORTS: tuple[str, ...] = WeightTransport.__args__  # type: ignore[attr-defined]
# Ray CPUs of each tensor-parallel worker of a cpu replica (ranks 1..tp-1; rank 0 is the replica).
TP_WORKER_CPUS = 1.0
# Names of the model configs a recipe can build without a download (see services/modeling).
ModelPreset = Literal["tiny-qwen2", "small-qwen2", "tiny-qwen3"]
MODEL_PRESETS: tuple[str, ...] = ModelPreset.__args__  # type: ignore[attr-defined]
# Resources Ray schedules by on its own (recipe fields num_gpus_per_rank, tensor_parallel, ...):
# a custom-resource table must not ask for them a second time.
_RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
# A custom Ray resource name: what `ray start --resources '{"<name>": n}'` gave some nodes.
RayResourceName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$")]
# Amounts of custom resources: Ray accepts fractions (down to 1e-4) and whole numbers.
RayResources = dict[RayResourceName, Annotated[float, Field(ge=1e-4, le=1e6)]]


def _custom_resources(value: dict[str, float]) -> dict[str, float]:
    builtin = sorted(_RAY_BUILTIN_RESOURCES & set(value))
    if builtin:
        raise ValueError(f"{', '.join(builtin)}: set by their own fields, not as custom resources")
    return value


# A tokenizer directory holds one of these: a Hugging Face tokenizer, or the char tokenizer's marker.
TOKENIZER_FILES = ("tokenizer.json", "looprl_tokenizer.json")


class Section(Schema):
    """A recipe section: TOML values are taken as they are typed (no "3" for 3), an integer is
    accepted where a number is expected."""

    model_config = ConfigDict(strict=True)


class RunSection(Section):
    """What the run is: its name, seed, length and how far sampling may run ahead of training."""

    name: str = "run"
    """Human-readable run name; the run id is derived from it when not given."""
    seed: int = Field(0, ge=0, le=INT64_MAX)
    """Seed for data generation, model init and sampling."""
    steps: Annotated[int, Field(ge=1), AtMost("max_steps")] = 20
    """Number of trainer steps (each publishes a new weight version)."""
    max_staleness: Annotated[int, Field(ge=0), AtMost("max_staleness")] = 0
    """Max trainer version minus sampling version; 0 = synchronous on-policy, k > 0 overlaps."""
    stall_seconds: float = Field(600.0, ge=1.0, le=7 * 86_400.0)
    """A running run that trains no step, feeds no step and receives no weight version for this long
    is marked STALLED (with the last error a component reported); it is RUNNING again once it
    progresses. Leave room for the first step, which loads the model and starts every replica."""

    @field_validator("name")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


def _local_dir(value: str, base_dir: Path | None) -> Path:
    """A recipe's local directory: services open it from their working directory; a recipe file may
    also name it relative to itself."""
    path = Path(value)
    if not path.is_absolute() and base_dir is not None and not path.is_dir():
        path = base_dir / path
    return path


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSection(Section):
    """[model.lora]: train low-rank adapters on the frozen base instead of the whole model. A weight
    version is then the adapter's tensors only, and deployments load the base once (model.path)."""

    rank: int = Field(16, ge=1, le=1024)
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = Field(32.0, gt=0.0, le=1e6)
    """The update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training."""
    target_modules: list[LoraTarget] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, max_length=7
    )
    """Projections of every decoder layer that get an adapter: the attention's by default; add
    gate_proj, up_proj and down_proj for every linear layer (about 3x the adapter's bytes)."""
    merge_on_export: bool = False
    """Also export the base with the adapter merged in (a plain Hugging Face model) beside the PEFT
    adapter directory."""

    @field_validator("target_modules")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        twice = next((t for i, t in enumerate(value) if t in value[:i]), None)
        if twice is not None:
            raise ValueError(f"{twice!r} is named twice")
        return value


def usable_dir(value: str, base_dir: Path | None, roots: tuple[Path, ...], files: tuple[str, ...]) -> bool:
    """Whether the recipe's directory `value` exists, lies under one of `roots` (symlinks resolved;
    any directory when there are none) and holds a readable one of `files`."""
    try:
        real = _local_dir(value, base_dir).resolve(strict=True)
        if roots and not any(real.is_relative_to(root.resolve()) for root in roots):
            return False
        return real.is_dir() and any(
            (real / name).is_file() and os.access(real / name, os.R_OK) for name in files
        )
    except (OSError, RuntimeError):  # missing, unreadable, a symlink loop
        return False


def _unusable(field: str, value: str, what: str, roots: tuple[Path, ...]) -> PydanticCustomError:
    """One answer for a directory that is missing, unreadable, outside the allowed roots or not of
    the right kind: a gateway answering each differently would tell a tenant what its host holds."""
    where = f" under {', '.join(map(str, roots))}" if roots else ""
    return field_error(field, f"{value!r} is not {what}{where} that this stack can read")


class ModelSection(Section):
    """The policy: a local Hugging Face directory or a built-in preset, and its tokenizer."""

    path: str = ""
    """Local Hugging Face model directory; empty builds `preset` from a config."""
    preset: ModelPreset = "tiny-qwen2"
    """Config preset used when path is empty."""
    tokenizer: str = "char"
    """'char' for the shipped character tokenizer, or a local tokenizer directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training and inference dtype."""
    init_std: float = Field(0.02, gt=0.0, le=10.0)
    """Std of the N(0, std) init of a preset model's weight matrices (0.1 suits tiny-qwen2)."""
    lora: LoraSection | None = None
    """Train LoRA adapters instead of the whole model ([model.lora]); needs `path` (the base every
    deployment loads once)."""
    implementation: Literal["auto", "fast", "generic"] = "auto"
    """Which code trains and serves the model: fast (looprl's own Qwen2/Llama/Qwen3, tensor-parallel
    layouts, vLLM), generic (transformers' modeling code for any causal LM: tp=1 cpu deployments,
    slower), or auto (fast where it implements the checkpoint's architecture and features)."""

    @model_validator(mode="after")
    def _directories_exist(self, info: ValidationInfo) -> ModelSection:
        context = info.context or {}
        base_dir = context.get("base_dir")
        roots = tuple(context.get("path_roots") or ())
        if self.path:
            if not usable_dir(self.path, base_dir, roots, ("config.json",)):
                raise _unusable("path", self.path, "a model directory (holding config.json)", roots)
            try:
                self.architecture(base_dir)
            except (ValueError, KeyError, TypeError) as exc:
                raise field_error("implementation", f"{self.path!r}: {exc}") from None
        if self.lora is not None and not self.path:
            raise field_error(
                "lora", "needs model.path: the base model directory every deployment loads once"
            )
        if self.tokenizer != "char" and not usable_dir(self.tokenizer, base_dir, roots, TOKENIZER_FILES):
            raise _unusable(
                "tokenizer",
                self.tokenizer,
                f"'char' or a tokenizer directory (holding {' or '.join(TOKENIZER_FILES)})",
                roots,
            )
        return self

    def architecture(self, base_dir: Path | None = None) -> ModelConfig:
        """The model's config: the directory's config.json or the preset, on the path
        `implementation` says (ValueError when "fast" cannot run the directory's model)."""
        from services.modeling.config import model_preset, read_config, with_implementation

        if self.path:
            return read_config(_local_dir(self.path, base_dir), self.implementation)
        return with_implementation(model_preset(self.preset), self.implementation)


def _first_non_finite(node: Any, where: str) -> tuple[str, float] | None:
    """(path, value) of the first inf or nan anywhere in `node` (tables and arrays included)."""
    if isinstance(node, dict):
        node = {f".{key}": value for key, value in node.items()}
    elif isinstance(node, list):
        node = {f"[{i}]": value for i, value in enumerate(node)}
    else:
        return (where, node) if isinstance(node, float) and not math.isfinite(node) else None
    for key, value in node.items():
        found = _first_non_finite(value, where + key)
        if found is not None:
            return found
    return None


class EnvironmentSection(Section):
    """Where episodes come from and how they are scored."""

    name: str = "digits"
    """Registered environment name (digits, guess, code, math)."""
    reward: str = ""
    """Registered reward name; empty uses the environment's default."""
    max_turns: int = Field(1, ge=1, le=1024)
    """Most model turns in one episode (multi-turn environments such as guess need more than 1); the
    Dr. GRPO constant normaliser is sampling.max_tokens times this."""
    config: dict[str, Any] = {}
    """Environment-specific settings (see the environment's config class)."""

    @field_validator("config")
    @classmethod
    def _plain_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        # TOML spells inf and nan, and one NaN hyper-parameter turns every weight into NaN.
        bad = _first_non_finite(value, "")
        if bad is not None:
            raise field_error(bad[0], f"must be a finite number, got {bad[1]}")
        if "max_turns" in value:
            raise field_error(
                "max_turns",
                "set environment.max_turns instead (the trainer's Dr. GRPO normaliser reads it too)",
            )
        return value


# How a dataset is stored: auto tells by the path (a .jsonl/.json or .parquet file or glob, or a
# Hugging Face `datasets` directory written by save_to_disk).
DatasetFormat = Literal["auto", "jsonl", "parquet", "hf"]


class DatasetSection(Section):
    """Where a run's prompts come from when not from the environment's own generator: a local JSONL
    or parquet file (or a glob of them), a Hugging Face `datasets` directory (save_to_disk), or a task
    source plugin. Each row becomes a task for the environment: its prompt (or chat messages), its
    reference answer and its metadata, plus every column as it is."""

    path: str = ""
    """Local .jsonl/.json or .parquet file, a glob of them (data/train-*.parquet), or a `datasets`
    directory (save_to_disk); relative to the recipe's directory, else to the services' working
    directory. Empty (and no source): the environment's own task generator."""
    format: DatasetFormat = "auto"
    """jsonl, parquet, hf (a save_to_disk directory), or auto: by the path's suffix, a directory being hf."""
    split: str = "train"
    """Split of a `datasets` directory holding several (a DatasetDict)."""
    source: str = ""
    """Task source plugin instead of a path: `module:function`, `file.py:function` or a
    `looprl.task_sources` entry point; called with source_config as keyword arguments, it returns the
    rows (an iterable of dicts)."""
    source_config: dict[str, Any] = {}
    """Keyword arguments of the task source plugin."""
    prompt_field: str = "prompt"
    """Column holding the prompt text (shown as one user message)."""
    messages_field: str = "messages"
    """Column holding the prompt as chat messages ([{"role", "content"}, ...]); used when present."""
    answer_field: str = "answer"
    """Column holding the reference answer (the reward's `answer`)."""
    metadata_fields: list[str] = []
    """Columns passed to the reward as metadata; empty: every column but the prompt and the answer."""
    source_field: str = "source"
    """Column naming a row's task source (evaluation reports each apart); rows without it belong to
    the environment's name."""
    shuffle: bool = True
    """Visit the rows in a seeded random order, a new order each epoch (seed: run.seed)."""
    epochs: Annotated[int, Field(ge=0), AtMost("max_steps")] = 0
    """Passes over the training rows the run may make; 0: as many as run.steps takes. A run whose
    steps need more rows than epochs x train rows is refused."""
    max_prompt_tokens: Count = 0
    """Rows whose prompt, rendered by the run's chat template, is longer are left out (and counted);
    0: the longest prompt a deployment accepts (max_model_len - sampling.max_tokens, within its
    max_prompt_tokens)."""
    eval_size: Count = 0
    """Rows held out of training for evaluation (a seeded draw after filtering)."""
    eval_path: str = ""
    """A separate file or directory of held-out rows (same format and fields); used instead of
    eval_size."""

    @field_validator("source_config")
    @classmethod
    def _finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = _first_non_finite(value, "")
        if bad is not None:
            raise field_error(bad[0], f"must be a finite number, got {bad[1]}")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.source)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSection:
        if self.path and self.source:
            raise field_error("source", "set dataset.path or dataset.source, not both")
        if not self.enabled and (self.eval_path or self.eval_size):
            raise field_error("path", "a held-out split needs a dataset: set dataset.path or dataset.source")
        if self.eval_path and self.eval_size:
            raise field_error("eval_size", "set dataset.eval_size or dataset.eval_path, not both")
        if self.source_config and not self.source:
            raise field_error("source_config", "only for a task source plugin (dataset.source)")
        return self


class RewardSection(Section):
    """A reward from the user's own code, instead of environment.reward."""

    function: str = ""
    """`module:function`, `file.py:function` (in the reward service's plugin directories) or a
    `looprl.rewards` entry point: `score(prompt, completion, answer, **metadata) -> float | dict`
    (a dict holds "score" and other named components)."""
    config: dict[str, Any] = {}
    """Settings passed to the function as keyword arguments, each a parameter it declares (checked
    against its annotations when the run is created)."""

    @field_validator("config")
    @classmethod
    def _finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = _first_non_finite(value, "")
        if bad is not None:
            raise field_error(bad[0], f"must be a finite number, got {bad[1]}")
        return value


class EvalSection(Section):
    """Evaluation on the held-out split while the run trains (and by `looprl eval` after it)."""

    every: Annotated[int, Field(ge=0), AtMost("max_steps")] = 0
    """Evaluate after every k-th step, and after the last one; 0: no evaluation during the run."""
    before_training: bool = True
    """Evaluate the initial weights too (step 0), when every > 0."""
    prompts: Annotated[int, Field(ge=0), AtMost("max_rollouts_per_step")] = 0
    """Held-out prompts per evaluation: 0 takes the dataset's whole held-out split, or 64 generated
    ones for an environment without a dataset."""
    greedy: bool = True
    """Sample each prompt greedily once (pass@1 is its pass rate)."""
    samples: Annotated[int, Field(ge=0), AtMost("max_group_size")] = 0
    """Seeded samples per prompt at sampling.temperature (pass@k with k = samples)."""
    pass_threshold: float = Field(1.0, ge=-1e9, le=1e9)
    """An episode passes when its reward is at least this."""
    checkpoint_step: int = Field(-1, ge=-1, le=INT32_MAX)
    """-1 for a training run. Otherwise the run trains nothing: it evaluates the weights of
    model.path once and records them as this step (what `looprl eval RUN --step N` submits)."""

    @model_validator(mode="after")
    def _something(self) -> EvalSection:
        if not self.greedy and self.samples == 0:
            raise field_error("samples", "must be > 0 when greedy = false (nothing would be sampled)")
        return self

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.checkpoint_step >= 0

    def versions(self, steps: int) -> list[int]:
        """The weight versions a training run of `steps` steps evaluates: 0 (before_training), every
        k-th and the last (the gateway evaluates them, the trainer exports them for `looprl eval`)."""
        if self.every <= 0 or self.checkpoint_step >= 0:
            return []
        versions = set(range(self.every, steps + 1, self.every)) | {steps}
        if self.before_training:
            versions.add(0)
        return sorted(versions)


class SamplingSection(Section):
    """How the deployments sample completions for training."""

    temperature: float = Field(1.0, gt=0.0, le=100.0)
    """Sampling temperature (> 0 for RL)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: Count = 0
    """Top-k truncation; 0 disables."""
    max_tokens: Annotated[int, Field(ge=1), AtMost("max_tokens")] = 16
    """Maximum generated tokens per model turn."""


class BatchSection(Section):
    """What one trainer step trains on."""

    rollouts_per_step: Annotated[int, Field(ge=1), AtMost("max_rollouts_per_step")] = 64
    """Rollouts per trainer step (the global batch); a multiple of group_size."""
    group_size: Annotated[int, Field(ge=1), AtMost("max_group_size")] = 8
    """Samples per prompt (GRPO group)."""
    max_tokens_per_microbatch: Annotated[int, Field(ge=1), AtMost("max_tokens_per_microbatch")] = 4096
    """Token budget of one packed micro-batch."""
    fork_groups: bool = True
    """One episode task per group that forks into group_size samples of the same prompt (one prefill,
    one request); false publishes one task per sample."""
    max_resample_batches: int = Field(4, ge=0, le=1000)
    """Every step trains a full batch: a group the packer drops while the step fills (equal rewards
    under algorithm.filter_equal_rewards, too stale under run.max_staleness, a straggler) is replaced
    by a newly sampled task, up to this many steps' worth of groups per step (DAPO's
    max_num_gen_batches less the first); a step that needs more fails the run, saying why its groups
    were dropped. 0: the first dropped group fails the run."""

    @model_validator(mode="after")
    def _whole_groups(self) -> BatchSection:
        if self.rollouts_per_step % self.group_size:
            raise field_error(
                "rollouts_per_step",
                f"{self.rollouts_per_step} is not divisible by batch.group_size {self.group_size}",
            )
        return self


class AlgorithmSection(Section):
    """The policy-gradient algorithm: advantages, the clipped loss and its regularisers."""

    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator."""
    filter_equal_rewards: bool = False
    """Drop groups whose rewards are all equal (no signal)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "constant"] = "token-mean"
    """How token losses add up to the step loss; constant is Dr. GRPO's (a sum over tokens divided by
    the longest possible completion)."""
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip range below 1."""
    clip_high: float = Field(0.28, ge=0.0, le=100.0)
    """PPO clip range above 1 (clip-higher)."""
    tis_cap: float = Field(2.0, ge=0.0, le=1e6)
    """Cap of the truncated importance weight for stale rollouts; 0 disables truncation."""
    kl_coef: float = Field(0.0, ge=0.0, le=1e6)
    """Weight of the KL penalty to the reference policy; 0 disables it."""
    entropy_coef: float = Field(0.0, ge=0.0, le=1e6)
    """Entropy bonus weight, relative to the advantage scale (keeps small policies exploring); 0
    disables."""
    group_timeout_seconds: Seconds = 120.0
    """A group still incomplete after this is released as is."""


# Where `looprl run` and `looprl watch` log a run (gateway/run_logs.py).
Logger = Literal["console", "tensorboard", "mlflow", "jsonl"]


class LoggingSection(Section):
    """What the run logs and where, beside the report `looprl run` writes (docs/logging.md)."""

    logger: list[Logger] = Field(["console", "tensorboard", "jsonl"], max_length=4)
    """Where the client following the run (`looprl run`, `looprl watch`) logs every scalar of the
    run's history and the sample tables: console (a progress line per update), tensorboard (event
    files in the run's report directory), mlflow (mlflow_tracking_uri; needs the MLflow client,
    `pip install -c requirements.lock -e '.[mlflow]'`), jsonl (metrics.jsonl and samples.jsonl in
    the report directory)."""
    samples_every: Annotated[int, Field(ge=0), AtMost("max_steps")] = 10
    """Record a table of sample completions every k steps (step 0 included); 0 records none."""
    samples_per_step: int = Field(8, ge=1, le=256)
    """Rows of a samples table: the step's first rollouts in its canonical order (by group id, then
    sample index), so a group's samples appear together with their advantages."""
    sample_chars: int = Field(2000, ge=16, le=65536)
    """Longest prompt or completion text a sample keeps (the rest is cut, with '...')."""
    mlflow_tracking_uri: str = Field("", max_length=2048)
    """MLflow tracking URI (http(s)://host:port, file:/path, sqlite:///path); empty: a file store
    `mlruns` in the run's report directory."""
    mlflow_experiment: str = Field("", max_length=256)
    """MLflow experiment the run logs to (created when missing); empty: the recipe's run.name."""

    @field_validator("logger")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} named more than once")
        return value


class OptimizerSection(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-3, gt=0.0, le=1.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=1e3)
    """AdamW weight decay."""
    betas: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field([0.9, 0.99], min_length=2, max_length=2)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW epsilon."""
    warmup_steps: Annotated[int, Field(ge=0), AtMost("max_steps")] = 0
    """Linear warmup steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    grad_clip: float = Field(1.0, ge=0.0, le=1e9)
    """Gradient norm clip; 0 disables."""


class TrainerSection(Section):
    """How the trainer ranks run."""

    world_size: Annotated[int, Field(ge=1), AtMost("max_world_size")] = 2
    """Data-parallel trainer ranks (Ray actors, FSDP2)."""
    checkpoint_every: Annotated[int, Field(ge=0), AtMost("max_steps")] = 10
    """Write a checkpoint every k steps (and on stop); 0 only on stop."""
    num_cpus_per_rank: float = Field(0.5, ge=0.0, le=1024.0)
    """Ray CPUs each rank reserves (its bundle in the trainer's placement group)."""
    num_gpus_per_rank: float = Field(0.0, ge=0.0, le=64.0)
    """GPUs each rank asks Ray for (1 on GPU nodes: the ranks then train with NCCL); 0 trains on
    CPU."""
    ray_resources_per_rank: RayResources = Field({}, max_length=16)
    """Custom Ray resources each rank asks for, e.g. { trainer_node = 1 }: the ranks then run only on
    nodes started with `ray start --resources '{"trainer_node": 1}'` (one rank per node with 1 each);
    empty places them anywhere. At most 16 names; amounts 1e-4 to 1e6; CPU and GPU are not custom."""

    _builtin = field_validator("ray_resources_per_rank")(_custom_resources)


def run_deployment_name(run_id: str, name: str) -> str:
    """A run's deployment as the router and weight-sync know it: `<run id>/<name>`. Recipe names are
    unique within a run; this makes them unique across the runs one stack serves at once."""
    return f"{run_id}/{name}"


class DisaggregationSection(Section):
    """[deployments.disaggregation]: prefill and decode on separate workers of one deployment. A
    prefill worker computes a prompt's KV cache and hands it to a decode worker (shared memory on
    one host, bytes over gRPC across hosts), which samples the whole completion; tokens and
    log-probs equal a co-located replica's for the same seed. Every worker holds the weights: the
    deployment's workers are one weight-sync target, staged everywhere and committed together, and
    KV made under one version is never decoded under another (the decode worker recomputes it)."""

    prefill_workers: Annotated[int, Field(ge=1), AtMost("max_replicas")] = 1
    """Workers that prefill prompts at the start (the deployment's replicas are prefill_workers +
    decode_workers)."""
    decode_workers: Annotated[int, Field(ge=1), AtMost("max_replicas")] = 1
    """Workers that decode at the start."""
    retune: bool = True
    """Re-tune the split at weight-version boundaries from the workers' measured prefill and decode
    tokens/s and the lengths of the requests routed here (services/decisions/pd_ratio.py), keeping
    prefill_workers + decode_workers; false keeps the split as written."""
    retune_min_requests: Annotated[int, Field(ge=1, le=INT32_MAX)] = 64
    """Requests observed since the last decision before the split may move."""
    retune_min_gain: float = Field(0.10, ge=0.0, le=10.0)
    """Predicted throughput gain over the current split a move must bring (hysteresis)."""
    kv_transfer: Literal["auto", "shm", "grpc"] = "auto"
    """cpu: how a decode worker receives a prompt's KV: auto (shared memory from a prefill worker
    on its host, gRPC from one elsewhere), shm (refuse other hosts' KV: recompute), or grpc."""
    kv_connector: Literal["NixlConnector"] = "NixlConnector"
    """vllm: the KV connector vLLM moves KV with (kv_transfer_config.kv_connector)."""


class DeploymentSpec(Section):
    """One inference deployment ([[deployments]]): its engine, its replicas and the length profile it is tuned for."""

    name: str = "default"
    """Deployment name, unique in the run."""
    backend: Literal["cpu", "vllm"] = "cpu"
    """Engine backend: cpu (embedded, torch) or vllm (GPU)."""
    model_path: str = ""
    """Local model directory; empty takes the architecture from the weights it is sent."""
    tensor_parallel: Annotated[int, Field(ge=1), AtMost("max_tensor_parallel")] = 1
    """Tensor-parallel degree of each replica (a vLLM replica requests this many GPUs)."""
    dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    """Weights and compute dtype; empty: bfloat16 for vllm, float32 for cpu."""
    gpu_memory_utilization: float = Field(0.0, ge=0.0, lt=1.0)
    """vllm: share of each GPU's memory a replica takes; 0 takes vLLM's default (0.85). Below 1 a
    tp=1 replica asks Ray for that fraction of a GPU, so several share one."""
    pause_mode: Literal["keep", "abort"] = "keep"
    """vllm: what in-flight requests do during a weight swap: keep (frozen, resumed after it) or
    abort (aborted, each completion then continues as a new request)."""
    replicas: Annotated[int, Field(ge=1), AtMost("max_replicas")] = 1
    """Number of replicas."""
    num_cpus: float = Field(1.0, ge=0.0, le=1024.0)
    """Ray CPUs each replica's actor reserves (on the cpu backend each extra tensor-parallel worker
    reserves its own)."""
    max_model_len: Annotated[int, Field(ge=1), AtMost("max_model_len")] = 512
    """Longest prompt + completion a replica accepts."""
    max_batch_size: Annotated[int, Field(ge=1), AtMost("max_batch_size")] = 32
    """Most sequences decoded together."""
    max_queued_requests: Annotated[int, Field(ge=1), AtMost("max_queued_requests")] = 256
    """Queue bound per replica before RESOURCE_EXHAUSTED."""
    min_prompt_tokens: Count = 0
    """Length profile: shortest prompt this deployment is tuned for."""
    max_prompt_tokens: Count = INT32_MAX
    """Length profile: longest prompt."""
    min_output_tokens: Count = 0
    """Length profile: shortest expected output."""
    max_output_tokens: Count = INT32_MAX
    """Length profile: longest expected output."""
    sync_every: Annotated[int, Field(ge=1), AtMost("max_steps")] = 1
    """Receive every k-th weight version."""
    enforce_eager: bool = False
    """vllm: run without CUDA graphs (starts faster, decodes slower)."""
    ray_resources: RayResources = Field({}, max_length=16)
    """Custom Ray resources each replica asks for, e.g. { zone_b = 1 }: its replicas then run only on
    nodes started with `ray start --resources '{"zone_b": ...}'`; empty places them anywhere. At most
    16 names; amounts 1e-4 to 1e6; CPU and GPU are not custom."""
    weight_transport: WeightTransport = "auto"
    """How weight-sync delivers weights to this deployment's replicas: auto (shared memory to
    co-located replicas, gRPC to the others), grpc, shm, shared_copy, cuda_ipc (a CUDA host; never
    run on a GPU yet) or nccl (refused: weight-sync creates no NCCL group yet)."""
    canary: bool = False
    """Canary weight updates: a new version serves on the first replica only until its greedy
    log-probs on golden prompts drift within canary_max_logprob_drift of the version before;
    otherwise it is rolled back there and never reaches the other replicas."""
    canary_max_logprob_drift: float = Field(0.0, ge=0.0, le=1e6)
    """Largest accepted mean |log-prob change| (nats) of the canary check; 0: weight-sync's
    default."""
    canary_tokens_per_prompt: Annotated[int, Field(ge=0), AtMost("max_tokens")] = 0
    """Greedy tokens per golden prompt in the canary check; 0: default."""
    max_loras: int = Field(0, ge=0, le=256)
    """LoRA runs ([model.lora]): adapters one replica serves at once over its base (one per run;
    a LoRA run's deployments serve at least its own). 0 for a run that trains the whole model."""
    max_lora_rank: int = Field(64, ge=1, le=512)
    """LoRA runs: the largest adapter rank this deployment serves (vllm reserves memory for it)."""
    shared: bool = False
    """LoRA runs of one base that name this deployment alike share its replicas: each replica loads
    the base (model.path) once and serves every such run's adapter, each request with its run's;
    up to max_loras runs at once, freed when the last of them ends."""
    disaggregation: DisaggregationSection | None = None
    """Prefill/decode disaggregation ([deployments.disaggregation]); absent: every replica prefills
    and decodes its own requests."""

    _builtin = field_validator("ray_resources")(_custom_resources)

    @property
    def gpus_per_replica(self) -> float:
        """GPUs a replica asks Ray for: a vLLM replica holds one per TP rank (its workers run on them);
        a tp=1 replica given a memory share below 1 asks for that fraction, so replicas can share a GPU;
        a cpu replica none."""
        if self.backend != "vllm":
            return 0.0
        if self.tensor_parallel == 1 and self.gpu_memory_utilization > 0:
            return self.gpu_memory_utilization
        return float(self.tensor_parallel)

    @property
    def cpus_per_replica(self) -> float:
        """CPUs a replica asks Ray for: its actor's `num_cpus`, and on the cpu backend TP_WORKER_CPUS for
        each tensor-parallel rank past the first (its TP workers)."""
        workers = self.tensor_parallel - 1 if self.backend == "cpu" else 0
        return self.num_cpus + workers * TP_WORKER_CPUS

    @property
    def serving_dtype(self) -> str:
        """`dtype`, or the backend's default when empty (bfloat16 on vLLM, float32 on CPU)."""
        return self.dtype or ("bfloat16" if self.backend == "vllm" else "float32")

    @model_validator(mode="after")
    def _profile_ordered(self) -> DeploymentSpec:
        if self.min_prompt_tokens > self.max_prompt_tokens:
            raise field_error("max_prompt_tokens", "must be >= min_prompt_tokens")
        if self.min_output_tokens > self.max_output_tokens:
            raise field_error("max_output_tokens", "must be >= min_output_tokens")
        if self.shared and self.max_loras < 1:
            raise field_error("shared", "a shared deployment serves LoRA runs' adapters: set max_loras >= 1")
        return self

    @model_validator(mode="after")
    def _workers(self, info: ValidationInfo) -> DeploymentSpec:
        """A disaggregated deployment's replicas are its prefill and decode workers."""
        pd = self.disaggregation
        if pd is None:
            return self
        workers = pd.prefill_workers + pd.decode_workers
        if "replicas" in self.model_fields_set and self.replicas != workers:
            raise field_error(
                "replicas",
                f"a disaggregated deployment's replicas are its {pd.prefill_workers} prefill + "
                f"{pd.decode_workers} decode workers ({workers}); leave replicas out or set it to {workers}",
            )
        limit = ((info.context or {}).get("limits") or _DEFAULT_LIMITS).max_replicas
        if workers > limit:
            raise field_error(
                "disaggregation",
                f"prefill_workers + decode_workers must be <= {limit} (this cluster's max_replicas), got {workers}",
            )
        if self.backend == "cpu" and self.tensor_parallel != 1:
            raise field_error(
                "disaggregation", "the cpu backend hands over the KV of tensor_parallel = 1 workers only"
            )
        if self.canary:
            raise field_error(
                "disaggregation",
                "not with canary: a canary commits a version on one replica first, a disaggregated "
                "deployment commits it on every worker together",
            )
        if self.max_loras or self.shared:
            raise field_error(
                "disaggregation",
                "not with LoRA adapters (max_loras, shared): a worker hands over the base's KV",
            )
        self.replicas = workers
        return self


class Recipe(Section):
    """A run: what to train, on what, with which algorithm, served by which deployments."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    environment: EnvironmentSection = EnvironmentSection()
    sampling: SamplingSection = SamplingSection()
    batch: BatchSection = BatchSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerSection = OptimizerSection()
    trainer: TrainerSection = TrainerSection()
    logging: LoggingSection = LoggingSection()
    deployments: list[DeploymentSpec] = Field([DeploymentSpec()], min_length=1)
    """The inference deployments that sample the run ([[deployments]] tables), each tuned to a
    length profile."""
    dataset: DatasetSection = DatasetSection()
    """The run's prompts from a dataset; without path or source: the environment's own generator."""
    reward: RewardSection = RewardSection()
    eval: EvalSection = EvalSection()

    @property
    def reward_name(self) -> str:
        """The reward episodes are scored by: reward.function, else environment.reward (empty: the
        environment's default)."""
        return self.reward.function or self.environment.reward

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt (tokens) a deployment of the run serves with room for sampling.max_tokens;
        dataset.max_prompt_tokens when smaller."""
        served = max(
            min(d.max_model_len - self.sampling.max_tokens, d.max_prompt_tokens) for d in self.deployments
        )
        limit = self.dataset.max_prompt_tokens
        return max(0, min(served, limit) if limit else served)

    @property
    def groups_per_step(self) -> int:
        return self.batch.rollouts_per_step // self.batch.group_size

    @property
    def resampled_groups_per_step(self) -> int:
        """The most groups fed to replace dropped ones while one step fills (batch.max_resample_batches)."""
        return self.batch.max_resample_batches * self.groups_per_step

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Recipe:
        limits = (info.context or {}).get("limits") or _DEFAULT_LIMITS
        if self.algorithm.advantage == "rloo" and self.batch.group_size < 2:
            raise field_error("batch.group_size", "rloo needs group_size > 1")
        if len(self.deployments) > limits.max_deployments:
            raise field_error(
                "deployments",
                f"must be at most {limits.max_deployments} (this cluster's max_deployments), "
                f"got {len(self.deployments)}",
            )
        if self.reward.function and self.environment.reward:
            raise field_error("reward.function", "set reward.function or environment.reward, not both")
        if self.reward.config and not self.reward.function:
            raise field_error("reward.config", "settings of a reward plugin: set reward.function too")
        names: set[str] = set()
        for i, d in enumerate(self.deployments):
            if d.name in names:
                raise field_error(f"deployments[{i}].name", f"duplicate deployment name {d.name!r}")
            names.add(d.name)
        for i, d in enumerate(self.deployments):
            if self.model.lora is None and (d.max_loras or d.shared):
                raise field_error(
                    f"deployments[{i}].max_loras", "serves LoRA runs' adapters; this run has no [model.lora]"
                )
            if self.model.lora is not None and d.disaggregation is not None:
                raise field_error(
                    f"deployments[{i}].disaggregation",
                    "not for a LoRA run ([model.lora]): its replicas serve adapters",
                )
            if self.model.lora is not None and d.tensor_parallel != 1:
                raise field_error(
                    f"deployments[{i}].tensor_parallel",
                    "a LoRA run's adapters are served at tensor_parallel = 1 (weight-sync splits A and B "
                    "like the base layer, but neither the tensor-parallel CPU engine nor vLLM at "
                    "tensor_parallel > 1 serves adapters here yet)",
                )
            if self.model.lora is not None and d.weight_transport == "shared_copy":
                raise field_error(
                    f"deployments[{i}].weight_transport",
                    "shared_copy replicas serve from weight-sync's copies; a LoRA run's adapters are staged by each",
                )
            if self.model.lora is not None and d.model_path and not self._same_base(d.model_path, info):
                # One answer whatever the directory holds (missing, unreadable, another model).
                raise field_error(
                    f"deployments[{i}].model_path",
                    "is not the base model.path names (a LoRA run's adapters apply to that base only)",
                )
            if self.model.lora is not None and self.model.lora.rank > d.max_lora_rank:
                raise field_error(
                    f"deployments[{i}].max_lora_rank",
                    f"{d.max_lora_rank} is below the run's adapter rank {self.model.lora.rank}",
                )
        if self.model.implementation != "fast":
            architecture = self.model.architecture((info.context or {}).get("base_dir"))
            if architecture.generic and self.model.lora is not None:
                raise field_error("model.lora", "adapters are served on the fast path (Qwen2, Llama, Qwen3)")
            for i, d in enumerate(self.deployments):
                if architecture.generic and (d.backend != "cpu" or d.tensor_parallel != 1):
                    raise field_error(
                        f"deployments[{i}]",
                        f"the model ({architecture.model_type!r}) runs on the generic path "
                        "(transformers' modeling code), served by cpu deployments of tensor_parallel = 1",
                    )
        longest = max(d.max_model_len for d in self.deployments)
        if self.sampling.max_tokens >= longest:
            # Every request would be refused by the router (prompt + max_tokens > max_model_len): a
            # run that could never sample a token.
            raise field_error("sampling.max_tokens", unservable_max_tokens(self.sampling.max_tokens, longest))
        return self

    def _same_base(self, model_path: str, info: ValidationInfo) -> bool:
        """Whether a deployment's model directory holds the architecture of model.path."""
        from services.modeling.config import read_config

        base_dir = (info.context or {}).get("base_dir")
        try:
            theirs = read_config(_local_dir(model_path, base_dir), self.model.implementation)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return theirs == self.model.architecture(base_dir)


def unservable_max_tokens(max_tokens: int, longest: int) -> str:
    """Why `max_tokens` per turn cannot be served by deployments of at most `longest` tokens."""
    return (
        f"{max_tokens} tokens per turn leave no room for a prompt in any deployment (the longest "
        f"max_model_len is {longest}): no request of this run could be served"
    )


def sampling_seed(run_seed: int, task_index: int, sample: int = 0) -> int:
    """The seed of sample `sample` of the run's `task_index`-th task: never 0 (0 means unseeded), the
    same in every process, so a run's samples depend on its seed alone. An n-completion request
    seeded s samples completion i with s + i (the engines' convention)."""
    return (run_seed * 1_000_003 + task_index * 1009 + sample) % (2**62) + 1


def parse_recipe(
    text: str,
    base_dir: Path | None = None,
    limits: RecipeLimits | None = None,
    path_roots: tuple[Path, ...] = (),
) -> Recipe:
    """Parse and validate recipe TOML text (against `limits`, the defaults when None). `path_roots`:
    the directories its model and tokenizer directories must lie under (none: anywhere)."""
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
    return parse(Recipe, data, RecipeError, "recipe", limits=limits, base_dir=base_dir, path_roots=path_roots)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def recipe_toml(recipe: Recipe) -> str:
    """The recipe as TOML text that parses back to an equal recipe (comments are not kept)."""
    lines: list[str] = []

    def fields(table: dict[str, Any]) -> list[str]:
        return [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]  # None: absent

    for name, value in recipe.model_dump().items():
        if name == "deployments":
            for table in value:
                lines += ["", "[[deployments]]", *fields(table)]
            continue
        # An optional section left out (model.lora) is omitted: TOML has no null, absent is None.
        lines += ["", f"[{name}]", *fields(value)]
    return "\n".join(lines).lstrip() + "\n"


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
    tenant: str = ""  # the gateway tenant that created it; only it (and admins) may see it
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
