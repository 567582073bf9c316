"""Configuration of the inference-router service (env vars LOOPRL_INFERENCE_ROUTER_<FIELD>).

Deployments come from the run recipe's [[deployments]] tables (services/kit/recipe.py
DeploymentSpec), either from a recipe file or inline as a JSON list of the same tables.
Imports nothing heavy: __main__ parses this before torch or Ray are loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from services.kit.config import ConfigError, ServiceConfig
from services.kit.recipe import DeploymentSpec, load_recipe


@dataclass
class RouterConfig(ServiceConfig):
    recipe: str = field(default="", metadata={"help": "Run recipe (TOML) whose [[deployments]] to serve."})
    deployments_json: str = field(
        default="",
        metadata={"help": "Deployments as a JSON list of [[deployments]] tables (overrides the recipe's)."},
    )
    run_id: str = field(default="", metadata={"help": "Run whose weights.published events to follow."})
    weight_sync_address: str = field(
        default="", metadata={"help": "WeightSyncService address to register targets with; empty skips."}
    )
    max_attempts: int = field(default=3, metadata={"help": "Replicas tried per request before UNAVAILABLE."})
    request_timeout_s: float = field(default=120.0, metadata={"help": "Per-attempt replica timeout."})
    version_wait_s: float = field(
        default=30.0,
        metadata={
            "help": "How long a request may wait for its min_weight_version to appear (the next version "
            "is normally one sync away, so waiting beats a failed episode)."
        },
    )
    version_unavailable_code: str = field(
        default="FAILED_PRECONDITION",
        metadata={
            "help": "Status when min_weight_version never appears: FAILED_PRECONDITION or UNAVAILABLE."
        },
    )
    unavailable_wait_s: float = field(
        default=5.0, metadata={"help": "How long a request waits for a healthy replica before UNAVAILABLE."}
    )
    status_interval_s: float = field(default=0.5, metadata={"help": "Replica status poll period."})
    max_sessions: int = field(default=100_000, metadata={"help": "Session-affinity map size (LRU)."})
    deployment_max_outstanding: int = field(
        default=0, metadata={"help": "Requests in flight per deployment (0: only per-replica bounds)."}
    )
    replica_num_cpus: float = field(default=1.0, metadata={"help": "Ray CPUs reserved per replica rank."})
    replica_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address each replica's InferenceEngineService binds and reports: 127.0.0.1 (every "
                          "replica on this host), 'node' (the address of the Ray node it runs on: several "
                          "hosts), or an explicit address."},
    )  # fmt: skip
    namespace: str = field(default="looprl-inference", metadata={"help": "Ray namespace of the replicas."})

    def __post_init__(self) -> None:
        if self.version_unavailable_code.upper() not in ("FAILED_PRECONDITION", "UNAVAILABLE"):
            raise ConfigError(
                "LOOPRL_INFERENCE_ROUTER_VERSION_UNAVAILABLE_CODE: must be FAILED_PRECONDITION or "
                f"UNAVAILABLE, got {self.version_unavailable_code!r}"
            )
        if self.max_attempts < 1:
            raise ConfigError(f"LOOPRL_INFERENCE_ROUTER_MAX_ATTEMPTS: must be >= 1, got {self.max_attempts}")

    def deployment_specs(self) -> list[DeploymentSpec]:
        if self.deployments_json:
            try:
                tables = json.loads(self.deployments_json)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS_JSON: not JSON: {exc}") from exc
            if not isinstance(tables, list):
                raise ConfigError("LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS_JSON: expected a JSON list of tables")
            return [spec_from_table(t, f"deployments[{i}]") for i, t in enumerate(tables)]
        if self.recipe:
            return list(load_recipe(self.recipe).deployments)
        return []


def spec_from_table(table: dict, where: str) -> DeploymentSpec:
    """A DeploymentSpec from one [[deployments]] table, naming unknown or mistyped fields."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    known = {f.name: f for f in dataclasses.fields(DeploymentSpec)}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown field (known: {', '.join(sorted(known))})")
        default = known[key].default
        if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, type(default)):
            raise ConfigError(f"{where}.{key}: expected {type(default).__name__}, got {value!r}")
    spec = DeploymentSpec(**table)
    if spec.replicas < 1 or spec.tensor_parallel < 1:
        raise ConfigError(f"{where}: replicas and tensor_parallel must be >= 1")
    return spec
