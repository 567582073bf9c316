"""Which code runs a causal LM: looprl's fast path or transformers' own (the generic path).

One place that turns a config or a checkpoint directory into the trainer's model, so the trainer,
its export and the tools agree: `ModelConfig.generic` picks `GenericCausalLM`
(services/modeling/generic.py), otherwise `Qwen2ForCausalLM` (qwen2.py, which also runs Llama and
Qwen3). A recipe's `model.implementation` decides for a checkpoint: "auto" takes the fast path
where it implements the architecture and every feature of the config, "fast" insists on it
(naming what it lacks), "generic" always runs transformers' code.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from services.modeling.config import Implementation, ModelConfig, read_config, with_implementation

if TYPE_CHECKING:
    from services.modeling.generic import GenericCausalLM
    from services.modeling.qwen2 import Qwen2ForCausalLM

__all__ = ["build", "causal_lm_class", "decoder_layers", "load", "read_config", "with_implementation"]


def causal_lm_class(config: ModelConfig) -> type[GenericCausalLM] | type[Qwen2ForCausalLM]:
    if config.generic:
        from services.modeling.generic import GenericCausalLM

        return GenericCausalLM
    from services.modeling.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM


def build(config: ModelConfig, seed: int, init_std: float) -> Any:
    """A model of `config` with deterministic weights (the same on every rank)."""
    model = causal_lm_class(config)(config, seed=None)
    model.init_weights(seed, std=init_std)
    return model


def load(
    directory: str | os.PathLike[str],
    implementation: Implementation = "auto",
    dtype: torch.dtype | None = None,
) -> Any:
    """The trainer's model from a checkpoint directory."""
    config = read_config(directory, implementation)
    return causal_lm_class(config).from_pretrained(directory, dtype=dtype)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers FSDP wraps one by one (none found: only the root is wrapped)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []
