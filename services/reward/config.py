"""Reward service settings (LOOPRL_REWARD_<FIELD> or LOOPRL_<FIELD>)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ServiceConfig


@dataclass
class RewardConfig(ServiceConfig):
    sandbox_address: str = field(
        default="", metadata={"help": "environment-sandbox gRPC address for code tests; empty: code fails"}
    )
    verifier_timeout_s: float = field(default=10.0, metadata={"help": "Per-component scoring time limit."})
    code_timeout_s: float = field(default=5.0, metadata={"help": "Wall-clock limit for one code-tests run."})
    compositions: dict = field(
        default_factory=dict,
        metadata={"help": 'Extra rewards: {"name": [["component", weight], ...]} (JSON).'},
    )
    reward_models: dict = field(
        default_factory=dict,
        metadata={
            "help": 'Reward models: {"name": {"model": "<local dir>|tiny", "min_replicas": 1, '
            '"max_replicas": 2, "max_batch": 16}} (JSON); needs Ray.'
        },
    )
    namespace: str = field(default="looprl-reward", metadata={"help": "Ray namespace of the replicas."})
