"""What a prefill and a decode step cost on a device: a named GPU's roofline, or a measured file.

Two kinds, one interface (`CostModel`):

- `RooflineCost(gpu, model)`: from a GPU's peak dense bf16 FLOP/s and memory bandwidth (`GPUS`) and
  a model's shape (`MODELS`, or `ModelShape.from_hf_config`). A prefill is compute-bound (2 x
  parameters FLOPs per token plus attention's quadratic term, at `mfu` of peak); a decode step is
  bandwidth-bound (every weight and the batch's KV cache read once, at `mbu` of peak) or
  compute-bound at large batches, whichever is slower, plus a fixed per-step overhead.
- `MeasuredCost`: fitted to a cost-model file's measured points (tools/gpu_torch_check.py writes
  one on a GPU, and on the CPU engine with `--cpu`): prefill seconds = a + b prompts + c tokens +
  d sum(len^2), a decode step = a + b batch + c context tokens, each coefficient non-negative (least
  squares, relative error).

The file format (JSON, `FORMAT`; `read_cost_file` checks every field and names the one that is wrong):

    {"format": "looprl-cost-model/1", "device": "NVIDIA H100 80GB HBM3", "device_kind": "cuda",
     "dtype": "bfloat16", "model": {"name": ..., "parameters": ..., "hidden_size": ..., ...},
     "prefill": [{"batch": 1, "prompt_tokens": 64, "seconds": 0.004}, ...],
     "decode": [{"batch": 8, "context_tokens": 512, "seconds_per_step": 0.011}, ...],
     "train": [{"tokens": 8192, "tokens_per_s": ...}],                     (optional)
     "transfer": {"kv_gb_per_s": ..., "cuda_ipc_gb_per_s": ..., "device_copy_gb_per_s": ...},  (optional)
     "created_by": "tools/gpu_torch_check.py", "created_unix": ...}

The tuner (pd_ratio.py) and the deployment simulator (sim/) take stage speeds from either kind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

FORMAT = "looprl-cost-model/1"


class CostModelError(ValueError):
    """A cost-model file or name that cannot be used; the message names the field."""


@dataclass(frozen=True)
class GpuSpec:
    """Peak figures of one GPU (dense, no sparsity), from the vendor's data sheet."""

    name: str
    bf16_tflops: float
    memory_gb_per_s: float
    memory_gib: float
    # What KV moves over between a prefill and a decode worker on one host (NVLink), GB/s.
    link_gb_per_s: float


GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("NVIDIA H100 SXM5 80GB", 989.0, 3350.0, 80.0, 450.0),
    "H200": GpuSpec("NVIDIA H200 SXM 141GB", 989.0, 4800.0, 141.0, 450.0),
    "A100": GpuSpec("NVIDIA A100 SXM4 80GB", 312.0, 2039.0, 80.0, 300.0),
    "L40S": GpuSpec("NVIDIA L40S 48GB", 362.0, 864.0, 48.0, 32.0),
}


@dataclass(frozen=True)
class ModelShape:
    """What costs depend on: parameters, layers, widths and the bytes of a weight."""

    name: str
    parameters: float
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_parameter: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return (
            2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.bytes_per_parameter
        )

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_parameter

    def attention_flops(self, query_tokens: float, key_tokens: float) -> float:
        """Scores and weighted values: 4 x layers x query width per (query, key) pair."""
        return (
            4.0
            * self.num_hidden_layers
            * self.num_attention_heads
            * self.head_dim
            * query_tokens
            * key_tokens
        )

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], name: str = "", bytes_per_parameter: int = 2
    ) -> ModelShape:
        """From a Hugging Face config.json (Qwen2 / Llama shaped)."""
        try:
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads", heads))
            head_dim = int(config.get("head_dim") or hidden // heads)
            inter = int(config["intermediate_size"])
            vocab = int(config["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CostModelError(f"model: not a Qwen2/Llama-shaped config ({exc})") from None
        per_layer = (
            hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
        )
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(
            name or str(config.get("_name_or_path", "model")),
            float(layers * per_layer + embeddings),
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            vocab,
            bytes_per_parameter,
        )


def _qwen2(name, hidden, layers, heads, kv_heads, inter, vocab=151936, tie=False) -> ModelShape:
    return ModelShape.from_hf_config(
        {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": inter,
            "vocab_size": vocab,
            "tie_word_embeddings": tie,
        },
        name,
    )


MODELS: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen2("qwen2.5-0.5b", 896, 24, 14, 2, 4864, tie=True),
    "qwen2.5-1.5b": _qwen2("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, tie=True),
    "qwen2.5-7b": _qwen2("qwen2.5-7b", 3584, 28, 28, 4, 18944),
}


class CostModel(Protocol):
    """Seconds of the two stages of generation on one worker (one GPU, or one CPU engine)."""

    name: str
    source: str

    def prefill_seconds(self, prompt_lengths: Sequence[int]) -> float:
        """One batched prefill of these prompts (their first tokens sampled)."""
        ...

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens of KV between them."""
        ...

    def kv_transfer_seconds(self, tokens: int) -> float:
        """Moving `tokens` tokens of KV cache from a prefill worker to a decode worker."""
        ...


def prefill_tokens_per_s(cost: CostModel, prompt_tokens: int, batch: int = 1) -> float:
    """Prompt tokens per second of one worker prefilling `batch` prompts of this length at a time."""
    lengths = [max(1, int(prompt_tokens))] * max(1, batch)
    return sum(lengths) / cost.prefill_seconds(lengths)


def decode_tokens_per_s(cost: CostModel, batch: int, context_per_sequence: int) -> float:
    """Tokens per second of one worker decoding `batch` sequences of this context length."""
    batch = max(1, batch)
    return batch / cost.decode_step_seconds(batch, batch * max(1, int(context_per_sequence)))


@dataclass(frozen=True)
class RooflineCost:
    """A named GPU's roofline for a model shape, at realistic fractions of peak."""

    gpu: GpuSpec
    model: ModelShape
    mfu: float = 0.5  # fraction of peak FLOP/s a prefill reaches
    mbu: float = 0.7  # fraction of peak memory bandwidth a decode step reaches
    step_overhead_s: float = 0.002  # scheduling, sampling and kernel launches per step
    link_efficiency: float = 0.8

    @property
    def name(self) -> str:
        return self.gpu.name

    @property
    def source(self) -> str:
        return f"roofline of {self.gpu.name} for {self.model.name}"

    def prefill_seconds(self, prompt_lengths: Sequence[int]) -> float:
        tokens = float(sum(prompt_lengths))
        flops = 2.0 * self.model.parameters * tokens + sum(
            self.model.attention_flops(n, n / 2.0) for n in prompt_lengths
        )
        compute = flops / (self.gpu.bf16_tflops * 1e12 * self.mfu)
        memory = self.model.weight_bytes / (self.gpu.memory_gb_per_s * 1e9 * self.mbu)
        return max(compute, memory) + self.step_overhead_s

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        flops = 2.0 * self.model.parameters * batch + self.model.attention_flops(1, context_tokens)
        read = self.model.weight_bytes + self.model.kv_bytes_per_token * context_tokens
        compute = flops / (self.gpu.bf16_tflops * 1e12 * self.mfu)
        memory = read / (self.gpu.memory_gb_per_s * 1e9 * self.mbu)
        return max(compute, memory) + self.step_overhead_s

    def kv_transfer_seconds(self, tokens: int) -> float:
        return self.model.kv_bytes_per_token * tokens / (self.gpu.link_gb_per_s * 1e9 * self.link_efficiency)

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV one GPU holds beside the weights."""
        free = self.gpu.memory_gib * 2**30 * memory_fraction - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))


def _fit_nonnegative(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: solve, drop the most negative term, solve again."""
    active = list(range(len(rows[0])))
    out = [0.0] * len(rows[0])
    while active:
        coef = _least_squares([[r[j] for j in active] for r in rows], targets)
        if coef is None:  # the points cannot tell these terms apart: keep the first ones
            active.pop()
            continue
        if all(c >= 0 for c in coef):
            for j, c in zip(active, coef, strict=True):
                out[j] = c
            return out
        active.pop(min(range(len(active)), key=coef.__getitem__))
    return out


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float] | None:
    """Normal equations by Gaussian elimination, each row weighted by 1/target (relative error)."""
    n = len(rows[0])
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for row, y in zip(rows, targets, strict=True):
        w = 1.0 / (y * y) if y > 0 else 1.0
        for i in range(n):
            b[i] += w * row[i] * y
            for j in range(n):
                a[i][j] += w * row[i] * row[j]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


@dataclass(frozen=True)
class MeasuredCost:
    """Stage costs fitted to a cost-model file's measured points."""

    name: str
    source: str
    prefill_coef: tuple[float, float, float, float]  # seconds = a + b prompts + c tokens + d sum(len^2)
    decode_coef: tuple[float, float, float]  # seconds = a + b batch + c context tokens
    kv_bytes_per_token: int = 0
    kv_gb_per_s: float = 0.0
    data: dict[str, Any] | None = None

    def prefill_seconds(self, prompt_lengths: Sequence[int]) -> float:
        a, b, c, d = self.prefill_coef
        return a + b * len(prompt_lengths) + c * sum(prompt_lengths) + d * sum(n * n for n in prompt_lengths)

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        a, b, c = self.decode_coef
        return a + b * batch + c * context_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        if not self.kv_gb_per_s or not self.kv_bytes_per_token:
            return 0.0
        return self.kv_bytes_per_token * tokens / (self.kv_gb_per_s * 1e9)

    @classmethod
    def from_data(cls, data: dict[str, Any], source: str = "measured") -> MeasuredCost:
        data = validate_cost_data(data)
        prefill_rows = [
            [1.0, p["batch"], p["batch"] * p["prompt_tokens"], p["batch"] * p["prompt_tokens"] ** 2]
            for p in data["prefill"]
        ]
        prefill = _fit_nonnegative(prefill_rows, [p["seconds"] for p in data["prefill"]])
        decode_rows = [[1.0, d["batch"], d["batch"] * d["context_tokens"]] for d in data["decode"]]
        decode = _fit_nonnegative(decode_rows, [d["seconds_per_step"] for d in data["decode"]])
        model = data.get("model", {})
        kv_bytes = 0
        if {"num_hidden_layers", "num_key_value_heads", "head_dim"} <= set(model):
            width = 2 if data.get("dtype") in ("bfloat16", "float16") else 4
            kv_bytes = (
                2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * width
            )
        return cls(
            data["device"],
            source,
            (prefill[0], prefill[1], prefill[2], prefill[3]),
            (decode[0], decode[1], decode[2]),
            kv_bytes,
            float(data.get("transfer", {}).get("kv_gb_per_s", 0.0)),
            data,
        )


def _number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CostModelError(f"{where}: must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise CostModelError(f"{where}: must be > 0, got {value!r}")
    return float(value)


def _points(data: dict[str, Any], name: str, fields: dict[str, bool]) -> list[dict[str, float]]:
    points = data.get(name)
    if not isinstance(points, list) or not points:
        raise CostModelError(f"{name}: must be a non-empty list of measured points")
    out = []
    for i, point in enumerate(points):
        if not isinstance(point, dict):
            raise CostModelError(f"{name}[{i}]: must be an object")
        checked = dict(point)
        for field_name, integer in fields.items():
            value = _number(point.get(field_name), f"{name}[{i}].{field_name}")
            checked[field_name] = int(value) if integer else value
        out.append(checked)
    return out


def validate_cost_data(data: Any) -> dict[str, Any]:
    """The parsed file, checked: every field that is wrong is named in the error."""
    if not isinstance(data, dict):
        raise CostModelError("cost model: must be a JSON object")
    if data.get("format") != FORMAT:
        raise CostModelError(f"format: must be {FORMAT!r}, got {data.get('format')!r}")
    if not isinstance(data.get("device"), str) or not data["device"].strip():
        raise CostModelError("device: must name the GPU (or CPU) that was measured")
    if data.get("device_kind") not in ("cuda", "cpu"):
        raise CostModelError(f"device_kind: must be 'cuda' or 'cpu', got {data.get('device_kind')!r}")
    checked = dict(data)
    checked["prefill"] = _points(data, "prefill", {"batch": True, "prompt_tokens": True, "seconds": False})
    checked["decode"] = _points(
        data, "decode", {"batch": True, "context_tokens": True, "seconds_per_step": False}
    )
    if "train" in data:
        checked["train"] = _points(data, "train", {"tokens": True, "tokens_per_s": False})
    transfer = data.get("transfer", {})
    if not isinstance(transfer, dict):
        raise CostModelError("transfer: must be an object of GB/s figures")
    for key, value in transfer.items():
        _number(value, f"transfer.{key}")
    if not isinstance(data.get("model", {}), dict):
        raise CostModelError("model: must be an object describing the measured model")
    return checked


def read_cost_file(path: str | Path) -> MeasuredCost:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CostModelError(f"cost model: file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise CostModelError(f"cost model: {str(path)!r} is not valid JSON ({exc})") from None
    return MeasuredCost.from_data(data, source=f"measured ({path.name})")


def write_cost_file(path: str | Path, data: dict[str, Any]) -> Path:
    """Validate and write a cost-model file (the measuring tool's output)."""
    validate_cost_data(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def cost_model(spec: str, model: ModelShape | str = "qwen2.5-7b") -> CostModel:
    """`roofline:<GPU>` (one of GPUS) for `model`, or the path of a measured cost-model file."""
    if spec.startswith("roofline:"):
        gpu = spec.split(":", 1)[1]
        if gpu not in GPUS:
            raise CostModelError(f"cost model: unknown GPU {gpu!r} (known: {', '.join(sorted(GPUS))})")
        shape = MODELS.get(model) if isinstance(model, str) else model
        if shape is None:
            raise CostModelError(f"model: unknown model shape {model!r} (known: {', '.join(sorted(MODELS))})")
        return RooflineCost(GPUS[gpu], shape)
    return read_cost_file(spec)


def shape_dict(shape: ModelShape) -> dict[str, Any]:
    return asdict(shape)
