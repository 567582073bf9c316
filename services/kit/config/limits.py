"""The most a run recipe may ask of the cluster, in one place.

The gateway admits runs against these limits (its configuration may lower or raise them, up to
their ceilings); recipe fields refer to them by name (services/kit/config/recipe.py `AtMost`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from services.kit.config.schema import Schema, parse
from services.kit.config.service import ConfigError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


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


Limit = Annotated[int, Field(ge=1, strict=True)]


class RecipeLimits(Schema):
    """The most a recipe may ask of the cluster. The gateway admits runs against its configured
    limits (GatewayConfig.recipe_limits); no limit may exceed its ceiling in `CEILINGS`, the most the
    code and the contracts can carry, so even a generous configuration cannot admit an overflow."""

    model_config = ConfigDict(frozen=True)

    max_recipe_bytes: Annotated[Limit, Field(le=CEILINGS["max_recipe_bytes"])] = 256 * 1024
    """Largest recipe text accepted."""
    max_steps: Annotated[Limit, Field(le=CEILINGS["max_steps"])] = 1_000_000
    """Most trainer steps of one run."""
    max_staleness: Annotated[Limit, Field(le=CEILINGS["max_staleness"])] = 64
    """Largest run.max_staleness."""
    max_rollouts_per_step: Annotated[Limit, Field(le=CEILINGS["max_rollouts_per_step"])] = 65_536
    """Largest batch.rollouts_per_step."""
    max_group_size: Annotated[Limit, Field(le=CEILINGS["max_group_size"])] = 256
    """Largest batch.group_size."""
    max_tokens: Annotated[Limit, Field(le=CEILINGS["max_tokens"])] = 131_072
    """Largest sampling.max_tokens (and canary tokens per prompt)."""
    max_model_len: Annotated[Limit, Field(le=CEILINGS["max_model_len"])] = 1_048_576
    """Largest deployments[].max_model_len."""
    max_tokens_per_microbatch: Annotated[Limit, Field(le=CEILINGS["max_tokens_per_microbatch"])] = 1_048_576
    """Largest batch.max_tokens_per_microbatch."""
    max_world_size: Annotated[Limit, Field(le=CEILINGS["max_world_size"])] = 1024
    """Largest trainer.world_size."""
    max_deployments: Annotated[Limit, Field(le=CEILINGS["max_deployments"])] = 64
    """Most deployments of one run."""
    max_replicas: Annotated[Limit, Field(le=CEILINGS["max_replicas"])] = 1024
    """Largest deployments[].replicas."""
    max_tensor_parallel: Annotated[Limit, Field(le=CEILINGS["max_tensor_parallel"])] = 64
    """Largest deployments[].tensor_parallel."""
    max_batch_size: Annotated[Limit, Field(le=CEILINGS["max_batch_size"])] = 4096
    """Largest deployments[].max_batch_size."""
    max_queued_requests: Annotated[Limit, Field(le=CEILINGS["max_queued_requests"])] = 65_536
    """Largest deployments[].max_queued_requests."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RecipeLimits:
        """Limits from configuration ({"max_rollouts_per_step": 4096, ...}); errors name the limit."""
        return parse(cls, values, ConfigError, "recipe limits")

    @classmethod
    def ceilings(cls) -> RecipeLimits:
        """The widest limits: what a recipe already admitted by some gateway is re-parsed with."""
        return cls(**CEILINGS)
