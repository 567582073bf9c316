"""Gateway configuration (environment variables LOOPRL_GATEWAY_<FIELD> or LOOPRL_<FIELD>)."""

from __future__ import annotations

from pydantic import Field

from services.kit.config import ServiceConfig
from services.kit.limits import RecipeLimits


class GatewayConfig(ServiceConfig):
    http_port: int = Field(0, ge=0, le=65535)
    """HTTP/JSON and OpenAI-compatible API port; 0 picks one."""
    tokens: str = ""
    """Comma-separated bearer tokens accepted on every external call; none is built in."""
    router_address: str = ""
    """inference-router gRPC address host:port."""
    sandbox_address: str = ""
    """environment-sandbox gRPC address; CreateRun refuses environments it does not serve."""
    reward_address: str = ""
    """reward gRPC address; CreateRun refuses rewards it does not serve."""
    packer_address: str = ""
    """rollout-packer gRPC address, for drop counts."""
    tokenizer: str = "char"
    """Tokenizer of the OpenAI-compatible endpoint while the stack has no run ('char' or a local directory);
    with a run it is the run's model.tokenizer."""
    exclusive_runs: bool = True
    """Refuse a new run once the stack served another: deployments and weight-sync number versions per stack,
    so a second run would sample from the first run's weights."""
    recipe_base_dir: str = "."
    """Relative model paths in recipes resolve here."""
    recipe_limits: RecipeLimits = RecipeLimits()
    """What a recipe may ask of this cluster, as JSON overriding the defaults of services.kit.limits.RecipeLimits (e.g.
    {"max_rollouts_per_step": 4096, "max_world_size": 8, "max_replicas": 16}); a recipe over a limit is
    refused with INVALID_ARGUMENT before its run exists."""
