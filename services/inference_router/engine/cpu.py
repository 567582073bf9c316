"""The embedded CPU engine: services/modeling EngineModel + slot KV cache + continuous batching.

`CPUEngine.create(config, weights, version, layout=...)` builds a tp=1 engine holding the weights in
its layout (HF names or fused qkv_proj/gate_up_proj, in the layout's dtype). `weights` may be a
full Hugging Face state dict (it is sharded into the layout) or the rank-0 shard already in the
layout's names; without weights the engine exists but is not ready until the first
`load_weights`. The scheduler (engine/scheduler.py) does the batching; this module only runs the
model for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.inference_router.engine.scheduler import ContinuousBatchingEngine, SchedulerLimits, StepExecutor
from services.modeling.config import ModelConfig
from services.modeling.engine_model import EngineModel
from services.modeling.layouts import Layout, hf_params, rank_params, shard_state_dict


def to_rank_shard(
    weights: Mapping[str, torch.Tensor], config: ModelConfig, layout: Layout, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard in the layout: `weights` is either that shard already or a full HF state dict."""
    own = {p.name for p in rank_params(config, layout, rank)}
    if set(weights) == own and all(
        tuple(weights[p.name].shape) == p.shape for p in rank_params(config, layout, rank)
    ):
        return {k: v.to(layout.torch_dtype) for k, v in weights.items()}
    hf = set(hf_params(config))
    if hf <= set(weights):
        return shard_state_dict(weights, config, layout, rank)
    missing = sorted(hf - set(weights))[:4]
    raise ValueError(
        f"weights: neither rank {rank}'s shard in the {layout.naming} layout nor a full HF state dict "
        f"(missing e.g. {missing})"
    )


class LocalExecutor(StepExecutor):
    """Runs one EngineModel (all of tp=1, or rank 0 of a group whose all_reduce is given), with the
    LoRA adapters it serves over its base."""

    serves_adapters = True

    def __init__(
        self,
        model: EngineModel,
        num_slots: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self.num_slots = num_slots
        self.cache = model.new_cache(num_slots, max_model_len)

    def prefill(
        self, slots: list[int], prompts: list[list[int]], adapters: list[str | None] | None = None
    ) -> torch.Tensor:
        return self.model.prefill_prompts(self.cache, slots, prompts, adapters)

    def decode(
        self,
        slots: list[int],
        tokens: list[int],
        positions: list[int],
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:
        return self.model.decode(
            self.cache,
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            adapters,
        )

    def load_adapter(self, name: str, adapter_config: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
        """Adapter `name`'s tensors: this rank's shard already, or the whole adapter (sharded here)."""
        self.model.check_adapter(name, adapter_config)
        own = {p.name for p in rank_params(adapter_config, self.model.layout, self.model.rank)}
        if set(state) != own or any(
            tuple(state[p.name].shape) != p.shape
            for p in rank_params(adapter_config, self.model.layout, self.model.rank)
        ):
            state = shard_state_dict(state, adapter_config, self.model.layout, self.model.rank)
        self.model.load_adapter(name, adapter_config, state)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        m = self.model
        m.load_shard(to_rank_shard(state_dict, m.config, m.layout, m.rank))

    @property
    def loaded(self) -> bool:
        return self.model.loaded

    def close(self) -> None:
        pass


class CPUEngine(ContinuousBatchingEngine):
    """Continuous-batching engine over a local tp=1 EngineModel."""

    executor: LocalExecutor

    async def serve_adapter(
        self,
        name: str,
        version: int,
        adapter_config: ModelConfig,
        state: Mapping[str, torch.Tensor],
        backwards: bool = False,
    ) -> None:
        """Serve LoRA adapter `name` (a run's) at `version`, between two steps, beside the others
        (`backwards`: a rollback to an older version)."""
        executor = self.executor
        assert isinstance(executor, LocalExecutor)
        await self.load_adapter(
            name, version, lambda: executor.load_adapter(name, adapter_config, state), backwards=backwards
        )

    def drop_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (its run ended); requests naming it are refused from now on."""
        self.abort_adapter(name)
        executor = self.executor
        assert isinstance(executor, LocalExecutor)
        self.when_no_step_runs(lambda: executor.model.drop_adapter(name))

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | None = None,
        version: int = 0,
        *,
        layout: Layout | None = None,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        limits: SchedulerLimits | None = None,
        device: str = "cpu",
    ) -> CPUEngine:
        """`device`: where the model and its KV cache live ("cuda" runs the same engine on a GPU,
        as tools/gpu_torch_check.py measures it)."""
        layout = layout or Layout()
        if layout.tp_size != 1:
            raise ValueError("CPUEngine runs tp=1; use engine.tp.TPEngine for tensor parallelism")
        model = EngineModel(config, layout, rank=0, device=device)
        if weights is not None:
            model.load_shard(to_rank_shard(weights, config, layout, 0))
        max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        return cls(
            LocalExecutor(model, max_batch_size, max_len), version if weights is not None else -1, limits
        )
