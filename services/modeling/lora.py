"""LoRA: low-rank adapters on a frozen base, in the names and format PEFT and vLLM use.

A `LoraSpec` (rank, alpha, dropout, target modules) turns each targeted `nn.Linear` of a model into a
`LoraLinear`: the base weight (and bias) keep their checkpoint names and are frozen, and the adapter
adds `lora_B(lora_A(dropout(x))) * alpha / rank` under `<module>.lora_A.weight` [rank, in] and
`<module>.lora_B.weight` [out, rank] - PEFT's saved names less its `base_model.model.` prefix. A is
initialised as PEFT does (Kaiming-uniform, a seeded generator here) and B with zeros, so a fresh
adapter is the base model exactly.

What travels: a version of a LoRA run is its adapter tensors only (`adapter_params`, the
"parameters" weight-sync plans a LoRA version by; `layouts.rank_params` splits them per TP rank as the
base layer is split). `save_peft` writes `adapter_config.json` + `adapter_model.safetensors` that
`peft.PeftModel.from_pretrained` and vLLM's LoRA loader read; `merged_state_dict` folds the adapter
into the base for a plain Hugging Face export.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Projections of a decoder layer LoRA can target, and the side of the layer each is split on under
# tensor parallelism: column-parallel outputs (A whole on every rank, B's rows split like the
# base's), row-parallel inputs (A's columns split like the base's, B whole).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
TARGETS = COLUMN_PARALLEL + ROW_PARALLEL
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank: must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError("lora.target_modules: name at least one projection")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"lora.target_modules: unknown {unknown} (choose from {list(TARGETS)})")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "lora_dropout": self.dropout,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoraSpec:
        return cls(
            int(d["r"]), float(d["lora_alpha"]), tuple(d["target_modules"]), float(d.get("lora_dropout", 0.0))
        )


def spec_of(section: Any) -> LoraSpec:
    """The LoraSpec of a recipe's [model.lora] section (services/kit/config/recipe.py LoraSection)."""
    return LoraSpec(section.rank, float(section.alpha), tuple(section.target_modules), float(section.dropout))


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (PEFT's LoRA Linear)."""

    def __init__(self, base: nn.Linear, spec: LoraSpec) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device)
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _targeted(model: nn.Module, spec: LoraSpec) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every targeted projection in the decoder layers (never lm_head)."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if attr in spec.targets and isinstance(child, nn.Linear) and ".layers." in f"{name}.":
                found.append((module, attr, child))
    if not found:
        raise ValueError(f"lora.target_modules: none of {list(spec.targets)} is a linear layer of this model")
    return found


def inject(model: nn.Module, spec: LoraSpec, seed: int | None = 0) -> nn.Module:
    """Freeze `model` and put a LoraLinear on every targeted projection (in place); with a seed, A is
    drawn from a seeded generator (the same on every rank) and B is zero."""
    model.requires_grad_(False)
    for parent, attr, linear in _targeted(model, spec):
        setattr(parent, attr, LoraLinear(linear, spec))
    if seed is not None:
        init_adapter(model, seed)
    return model


@torch.no_grad()
def init_adapter(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLinear):
            a = module.lora_A.weight
            bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) as PEFT and nn.Linear do
            a.copy_((torch.rand(a.shape, generator=gen) * 2 - 1).mul_(bound).to(a.dtype))
            module.lora_B.weight.zero_()


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    return {name: p for name, p in model.named_parameters() if is_adapter_param(name)}


def adapter_params(base_params: Mapping[str, tuple[int, ...]], spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """The adapter's tensors (names, shapes) for a base whose parameters are `base_params`."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in base_params.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in spec.targets or ".layers." not in name:
            continue
        out_features, in_features = shape
        out[f"{module}.lora_A.weight"] = (spec.rank, in_features)
        out[f"{module}.lora_B.weight"] = (out_features, spec.rank)
    return out


def merged_state_dict(
    base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], spec: LoraSpec
) -> dict[str, Tensor]:
    """The base with every adapter folded in: W + scaling * B @ A (for a plain HF export)."""
    merged = dict(base)
    for name in adapter:
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            a, b = adapter[name].float(), adapter[f"{module}.lora_B.weight"].float()
            w = merged[f"{module}.weight"]
            merged[f"{module}.weight"] = (w.float() + spec.scaling * (b @ a)).to(w.dtype)
    return merged


def save_peft(
    directory: str | os.PathLike[str],
    adapter: Mapping[str, Tensor],
    spec: LoraSpec,
    base_model: str = "",
    architecture: str = "",
) -> None:
    """adapter_config.json + adapter_model.safetensors as PEFT writes them (peft and vLLM load it)."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "revision": None,
        "auto_mapping": {"base_model_class": architecture} if architecture else None,
    }
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {PEFT_PREFIX + name: t.detach().contiguous().cpu() for name, t in adapter.items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def load_peft(directory: str | os.PathLike[str]) -> tuple[LoraSpec, dict[str, Tensor]]:
    """The spec and adapter tensors (looprl's names) of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    path = Path(directory)
    config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    spec = LoraSpec.from_dict(config)
    tensors = load_file(str(path / ADAPTER_WEIGHTS_FILE))
    return spec, {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}


def trainable(params: Iterable[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    return [p for _, p in params if p.requires_grad]
