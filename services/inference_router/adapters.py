"""LoRA adapters on a replica: each run's adapter staged, committed and rolled back beside the base.

A replica whose deployment serves LoRA runs (`DeploymentSpec.max_loras` > 0) loads its base once
(`model_path`) and receives, per run, versions that are the run's adapter tensors only
(StageWeightsRequest.adapter names the run). Each adapter goes through the same lifecycle as a
tp=1 engine's weights (`LocalWeights`: a stager beside what is served, commit between two decode
steps, rollback to the version before): `AdapterSlot` is the Engine face of one adapter of an
engine that serves adapters (the CPU engine: in its batches; vLLM: as LoRA adapters it loads by
name, engine/vllm_lora.py), whose weight version is that adapter's. Requests of a run are served with its adapter
(`EngineRequest.adapter`), at that adapter's version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from services.inference_router.engine.base import EngineStatus
from services.inference_router.weights import LocalWeights
from services.kit.rpc import errors
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weights.stager import WeightStager

if TYPE_CHECKING:
    from services.inference_router.engine.cpu import CPUEngine


class AdapterSlot:
    """One adapter of a CPU engine, as the `Engine` a `LocalWeights` lifecycle drives."""

    def __init__(self, engine: CPUEngine, name: str, config: ModelConfig) -> None:
        self.engine, self.name, self.config = engine, name, config

    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        await self.engine.serve_adapter(self.name, version, self.config, state_dict)

    async def rollback(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        await self.engine.serve_adapter(self.name, version, self.config, state_dict, backwards=True)

    def status(self) -> EngineStatus:
        return dataclasses.replace(
            self.engine.status(), weight_version=self.engine.adapter_versions.get(self.name, -1)
        )


class Adapters:
    """The adapters of one replica, by run id, bounded by its slots."""

    def __init__(self, engine: CPUEngine, base: ModelConfig, layout: Layout, slots: int) -> None:
        self.engine, self.base, self.layout, self.slots = engine, base, layout, slots
        self.lifecycles: dict[str, LocalWeights] = {}

    def get(self, name: str, config: ModelConfig | None) -> LocalWeights:
        """The lifecycle of adapter `name`, created from the adapter config its first bucket carries."""
        weights = self.lifecycles.get(name)
        if weights is not None:
            if config is not None and config != weights.engine.config:  # type: ignore[attr-defined]
                raise errors.InvalidArgument(f"model_config_json: adapter {name!r} changed its configuration")
            return weights
        if config is None:
            raise errors.FailedPrecondition(
                f"model_config_json: adapter {name!r} is new here; its first bucket must carry its config"
            )
        if config.lora is None or config.base != self.base:
            raise errors.InvalidArgument(
                f"adapter: {name!r}'s config is not a LoRA adapter of the base this replica serves"
            )
        if len(self.lifecycles) >= self.slots:
            raise errors.ResourceExhausted(
                f"adapter: all {self.slots} adapter slots (max_loras) of this replica hold other runs' adapters"
            )
        slot = AdapterSlot(self.engine, name, config)
        weights = LocalWeights(slot, WeightStager(rank_params(config, self.layout, 0)))  # type: ignore[arg-type]
        self.lifecycles[name] = weights
        return weights

    def of(self, name: str) -> LocalWeights:
        weights = self.lifecycles.get(name)
        if weights is None:
            raise errors.FailedPrecondition(f"adapter: {name!r} has nothing staged or served on this replica")
        return weights

    def drop(self, name: str) -> None:
        """Free a run's slot (the run ended)."""
        self.lifecycles.pop(name, None)
        self.engine.drop_adapter(name)

    def versions(self) -> dict[str, int]:
        return {name: v for name, v in self.engine.adapter_versions.items() if name in self.lifecycles}
