"""What every trainer rank needs to build the same policy: a picklable spec, and its derivation from a
run recipe (services/kit/recipe.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from services.modeling.config import ModelConfig, model_preset
from services.trainer.loss import LossConfig
from services.trainer.optim import OptimizerSpec

# The recipe's name for Dr. GRPO's constant normaliser.
_AGGREGATION_ALIASES = {"constant": "seq-mean-token-sum-norm"}


@dataclass
class TrainerSpec:
    model: dict[str, Any] = field(default_factory=lambda: ModelConfig.tiny().to_dict())
    # A local Hugging Face directory; when set it wins over `model` and `seed`.
    model_path: str = ""
    seed: int = 0
    # Std of the weight-matrix init of a model built from `model` (ignored with model_path).
    init_std: float = 0.02
    # "float32" or "bfloat16": compute dtype (mixed precision on GPU); master weights stay float32.
    dtype: str = "float32"
    temperature: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    run_id: str = ""
    # The run's tokenizer ("char" or a local tokenizer directory) and its recipe (Recipe.to_dict()):
    # the Hugging Face export writes the tokenizer files and lists the recipe in the model card.
    tokenizer: str = "char"
    recipe: dict[str, Any] = field(default_factory=dict)
    # Dtype of the shards sent to weight-sync ("" = the parameters' own dtype).
    push_dtype: str = ""
    push_max_bytes: int = 16 << 20
    # Wrap every decoder layer with fully_shard (and the root); False shards only the root.
    shard_layers: bool = True

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def spec_from_recipe(recipe: Any, run_id: str) -> TrainerSpec:
    """TrainerSpec from a parsed kit Recipe."""
    model = None if recipe.model.path else model_preset(recipe.model.preset)
    algo, opt = recipe.algorithm, recipe.optimizer
    loss = LossConfig(
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        tis_cap=algo.tis_cap,
        kl_coef=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        aggregation=_AGGREGATION_ALIASES.get(algo.loss_aggregation, algo.loss_aggregation),
        max_tokens=recipe.sampling.max_tokens * recipe.environment.max_turns,
    )
    loss.validate()
    return TrainerSpec(
        model=model.to_dict() if model is not None else ModelConfig.tiny().to_dict(),
        model_path=recipe.model.path,
        seed=recipe.run.seed,
        init_std=recipe.model.init_std,
        dtype=recipe.model.dtype,
        temperature=recipe.sampling.temperature,
        loss=loss,
        optimizer=OptimizerSpec(
            lr=opt.lr,
            betas=list(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            warmup_steps=opt.warmup_steps,
            schedule=opt.schedule,
            total_steps=recipe.run.steps,
            grad_clip=opt.grad_clip,
        ),
        run_id=run_id,
        tokenizer=recipe.model.tokenizer,
        recipe=recipe.to_dict(),
    )
