"""The CPU engine on the generic path: transformers' own modeling code behind the continuous batcher.

`GenericEngine.create(config, weights, version)` serves a model looprl's fast path does not
implement (services/modeling/generic.py): the same scheduler, sampling and weight swaps as
engine/cpu.py, with a `DynamicCache` per slot instead of the fast path's slot KV cache. tp=1 only;
weights arrive under the checkpoint's own names.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.inference_router.engine.scheduler import ContinuousBatchingEngine, SchedulerLimits
from services.modeling.config import ModelConfig
from services.modeling.generic import GenericEngineModel
from services.modeling.layouts import DTYPES


class GenericExecutor:
    """The StepExecutor of a GenericEngineModel."""

    def __init__(self, model: GenericEngineModel) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_model_len = model.max_len
        self.num_slots = model.max_slots

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        return self.model.prefill_prompts(slots, prompts)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        return self.model.decode(slots, tokens, positions)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.model.load(state_dict)

    @property
    def loaded(self) -> bool:
        return self.model.loaded

    def close(self) -> None:
        pass


class GenericEngine(ContinuousBatchingEngine):
    """Continuous batching over a GenericEngineModel."""

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | None = None,
        version: int = 0,
        *,
        dtype: str = "float32",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        limits: SchedulerLimits | None = None,
    ) -> GenericEngine:
        max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        model = GenericEngineModel(config, max_batch_size, max_len, DTYPES[dtype])
        if weights is not None:
            model.load(weights)
        return cls(GenericExecutor(model), version if weights is not None else -1, limits)
