"""Gateway configuration (environment variables LOOPRL_GATEWAY_<FIELD> or LOOPRL_<FIELD>)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ConfigError, ServiceConfig
from services.kit.limits import RecipeLimits


@dataclass
class GatewayConfig(ServiceConfig):
    http_port: int = field(
        default=0, metadata={"help": "HTTP/JSON and OpenAI-compatible API port; 0 picks one."}
    )
    tokens: str = field(
        default="",
        metadata={"help": "Comma-separated bearer tokens accepted on every external call; none is built in."},
    )
    router_address: str = field(default="", metadata={"help": "inference-router gRPC address host:port."})
    sandbox_address: str = field(
        default="",
        metadata={
            "help": "environment-sandbox gRPC address; CreateRun refuses environments it does not serve."
        },
    )
    reward_address: str = field(
        default="", metadata={"help": "reward gRPC address; CreateRun refuses rewards it does not serve."}
    )
    packer_address: str = field(
        default="", metadata={"help": "rollout-packer gRPC address, for drop counts."}
    )
    tokenizer: str = field(
        default="char",
        metadata={
            "help": "Tokenizer of the OpenAI-compatible endpoint while the stack has no run ('char' or a "
            "local directory); with a run it is the run's model.tokenizer."
        },
    )
    exclusive_runs: bool = field(
        default=True,
        metadata={
            "help": "Refuse a new run once the stack served another: deployments and weight-sync number "
            "versions per stack, so a second run would sample from the first run's weights."
        },
    )
    recipe_base_dir: str = field(
        default=".", metadata={"help": "Relative model paths in recipes resolve here."}
    )
    recipe_limits: dict = field(
        default_factory=dict,
        metadata={
            "help": "What a recipe may ask of this cluster, as JSON overriding services.kit.limits.RecipeLimits "
            '(e.g. {"max_rollouts_per_step": 4096, "max_world_size": 8, "max_replicas": 16}); a recipe over '
            "a limit is refused with INVALID_ARGUMENT before its run exists."
        },
    )

    def __post_init__(self) -> None:
        self.limits()  # a bad limit is a configuration error at start-up, naming the limit

    def limits(self) -> RecipeLimits:
        """The cluster limits recipes are admitted against."""
        if not isinstance(self.recipe_limits, dict):
            raise ConfigError(f"recipe_limits: must be a JSON object, got {self.recipe_limits!r}")
        return RecipeLimits.from_dict(self.recipe_limits)
