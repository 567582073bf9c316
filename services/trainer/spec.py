"""What every trainer rank needs to build the same policy: a picklable spec, and its derivation from a
run recipe (services/kit/config/recipe.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.kit.config.recipe import Recipe
from services.modeling.config import ModelConfig


@dataclass
class TrainerSpec:
    """The run's recipe as is (parsed and validated: every run setting is read from its sections),
    plus what the recipe does not say."""

    recipe: Recipe = field(default_factory=Recipe)
    run_id: str = ""
    # The resolved architecture of a model built from a config (recipe.model.preset, or a test's own);
    # empty: the recipe's preset. Ignored when recipe.model.path names a Hugging Face directory.
    architecture: dict[str, Any] = field(default_factory=dict)
    # Dtype of the shards sent to weight-sync ("" = the parameters' own dtype).
    push_dtype: str = ""
    push_max_bytes: int = 16 << 20
    # Wrap every decoder layer with fully_shard (and the root); False shards only the root; None
    # decides by size (SHARD_LAYERS_ABOVE_PARAMS).
    shard_layers: bool | None = None

    def model_config(self) -> ModelConfig:
        if self.architecture:
            return ModelConfig(**self.architecture)
        return self.recipe.model.architecture()

    @property
    def loss_max_tokens(self) -> int:
        """Dr. GRPO's constant normaliser: the most tokens one episode can train."""
        return self.recipe.sampling.max_tokens * self.recipe.environment.max_turns

    @property
    def total_steps(self) -> int:
        return self.recipe.run.steps

    def to_dict(self) -> dict[str, Any]:
        """The recipe's sections (Recipe.to_dict()) and the trainer's own settings beside them."""
        return {
            **self.recipe.to_dict(),
            "run_id": self.run_id,
            "architecture": self.architecture,
            "push_dtype": self.push_dtype,
            "push_max_bytes": self.push_max_bytes,
            "shard_layers": self.shard_layers,
        }


# Per-layer wrapping bounds the unsharded parameters to one layer at a time, which is what lets a
# large model fit; below this size the whole model unsharded is a few hundred MB at most, and one
# all-gather and one reduce-scatter a micro-batch cost less than one of each per layer (on the
# default recipe's 2 CPU ranks; bench/loop_vs_single_process.py measures the step).
SHARD_LAYERS_ABOVE_PARAMS = 50_000_000


def shards_layers(spec: TrainerSpec, parameters: int) -> bool:
    """Whether the trainer wraps each decoder layer in its own FSDP unit."""
    return spec.shard_layers if spec.shard_layers is not None else parameters > SHARD_LAYERS_ABOVE_PARAMS


def spec_from_recipe(recipe: Recipe, run_id: str) -> TrainerSpec:
    """TrainerSpec from a parsed kit Recipe."""
    architecture = {} if recipe.model.path else recipe.model.architecture().to_dict()
    return TrainerSpec(recipe=recipe, run_id=run_id, architecture=architecture)
