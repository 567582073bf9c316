"""The most a run recipe may ask of the cluster, in one place.

The gateway admits runs against these limits (its configuration may lower or raise them, up to
their ceilings); services/kit/recipe.py holds the bounds table that refers to them by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.kit.config import ConfigError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RecipeLimits:
    """The most a recipe may ask of the cluster. The gateway admits runs against its configured
    limits (GatewayConfig.recipe_limits); no limit may exceed its ceiling in `CEILINGS`, the most the
    code and the contracts can carry, so even a generous configuration cannot admit an overflow."""

    max_recipe_bytes: int = 256 * 1024
    max_steps: int = 1_000_000
    max_staleness: int = 64
    max_rollouts_per_step: int = 65_536
    max_group_size: int = 256
    max_tokens: int = 131_072
    max_model_len: int = 1_048_576
    max_tokens_per_microbatch: int = 1_048_576
    max_world_size: int = 1024
    max_deployments: int = 64
    max_replicas: int = 1024
    max_tensor_parallel: int = 64
    max_batch_size: int = 4096
    max_queued_requests: int = 65_536

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, ceiling = getattr(self, f.name), CEILINGS[f.name]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ceiling:
                raise ConfigError(
                    f"recipe limit {f.name}: must be an integer in [1, {ceiling}], got {value!r}"
                )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RecipeLimits:
        """Limits from configuration ({"max_rollouts_per_step": 4096, ...}); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"recipe limit {unknown[0]}: unknown (known: {', '.join(sorted(known))})")
        return cls(**values)

    @classmethod
    def ceilings(cls) -> RecipeLimits:
        """The widest limits: what a recipe already admitted by some gateway is re-parsed with."""
        return cls(**CEILINGS)


# The largest value each limit may be configured to. max_group_size: an episode forks into at most
# 256 branches (environment-sandbox) and a request samples at most 256 completions (router).
CEILINGS: dict[str, int] = {
    "max_recipe_bytes": 16 << 20,
    "max_steps": 1_000_000_000,
    "max_staleness": 1024,
    "max_rollouts_per_step": 1 << 22,
    "max_group_size": 256,
    "max_tokens": INT32_MAX,
    "max_model_len": INT32_MAX,
    "max_tokens_per_microbatch": INT32_MAX,
    "max_world_size": 65_536,
    "max_deployments": 1024,
    "max_replicas": 65_536,
    "max_tensor_parallel": 1024,
    "max_batch_size": 1 << 20,
    "max_queued_requests": 1 << 24,
}
