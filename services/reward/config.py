"""Reward service settings (LOOPRL_REWARD_<FIELD> or LOOPRL_<FIELD>) and the settings of each reward
model pool it serves. Imports nothing heavy."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.kit.config.schema import Schema, field_error
from services.kit.config.service import ServiceConfig

# The reward model built from a config when no local directory is named.
TINY = "tiny"


class ModelPoolConfig(Schema):
    """One reward model served by autoscaled Ray replicas behind a batching front."""

    model: str = TINY
    """Local sequence-classification model directory, or 'tiny' for a small model built from a
    config."""
    min_replicas: int = Field(1, ge=0)
    """Replicas kept while idle."""
    max_replicas: int = Field(2, ge=1)
    """Most replicas the pool scales to."""
    max_batch: int = Field(16, ge=1)
    """Texts scored in one replica call."""
    max_wait_s: float = Field(0.01, ge=0.0)
    """How long the front waits to fill a batch."""
    target_queue_per_replica: float = Field(16.0, gt=0.0)
    """Queued texts per replica above which the pool scales up."""
    scale_interval_s: float = Field(0.2, gt=0.0)
    """Period of the autoscaler's decisions."""
    scale_down_after_s: float = Field(10.0, ge=0.0)
    """Idle time before a replica beyond min_replicas is retired."""
    transform: Literal["sigmoid", "none"] = "sigmoid"
    """Applied to the model's logit: sigmoid (a score in (0, 1)) or none (the raw logit)."""

    @model_validator(mode="after")
    def _ordered(self) -> ModelPoolConfig:
        if self.min_replicas > self.max_replicas:
            raise field_error("max_replicas", f"must be >= min_replicas ({self.min_replicas})")
        return self


Component = tuple[str, Annotated[float, Field(allow_inf_nan=False)]]


class RewardConfig(ServiceConfig):
    sandbox_address: str = ""
    """environment-sandbox gRPC address for code tests; empty: code fails."""
    verifier_timeout_s: float = Field(10.0, gt=0.0)
    """Per-component scoring time limit."""
    code_timeout_s: float = Field(5.0, gt=0.0)
    """Wall-clock limit for one code-tests run."""
    compositions: dict[str, list[Component]] = {}
    """Extra rewards: {"name": [["component", weight], ...]} (JSON)."""
    reward_models: dict[str, ModelPoolConfig] = {}
    """Reward models by name: {"name": {"model": "<local dir>|tiny", "max_replicas": 2, ...}} (JSON;
    fields as ModelPoolConfig); needs Ray."""
    namespace: str = "looprl-reward"
    """Ray namespace of the replicas."""
    plugin_dirs: str = ""
    """Directories (':'- or ','-separated) plugin rewards are loaded from: a recipe's
    `file.py:function` and `module:function` must lie in one (each is put on sys.path); installed
    packages declaring a looprl entry point need none. Empty: only those packages."""
