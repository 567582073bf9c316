"""Configuration of the inference-router service (env vars LOOPRL_INFERENCE_ROUTER_<FIELD>).

Deployments are the run recipe's [[deployments]] tables (services/kit/config/recipe.py DeploymentSpec),
from a recipe file or inline as a JSON list of the same tables.
Imports nothing heavy: __main__ parses this before torch or Ray are loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.kit.config.recipe import DeploymentSpec, RecipeError, load_recipe
from services.kit.config.schema import field_error
from services.kit.config.service import ServiceConfig


class RouterConfig(ServiceConfig):
    recipe: str = ""
    """Run recipe (TOML) whose [[deployments]] to serve."""
    deployments: list[DeploymentSpec] = []
    """Deployments as a JSON list of [[deployments]] tables (instead of the recipe's)."""
    run_id: str = ""
    """Run whose weights.published events to follow."""
    weight_sync_address: str = ""
    """WeightSyncService address to register targets with; empty skips."""
    max_attempts: int = Field(3, ge=1)
    """Replicas tried per request before UNAVAILABLE."""
    request_timeout_s: float = Field(120.0, gt=0.0)
    """Per-attempt replica timeout."""
    version_wait_s: float = Field(30.0, ge=0.0)
    """How long a request may wait for its min_weight_version to appear (the next version is normally one sync
    away, so waiting beats a failed episode)."""
    version_unavailable_code: Literal["FAILED_PRECONDITION", "UNAVAILABLE"] = "FAILED_PRECONDITION"
    """Status when min_weight_version never appears: FAILED_PRECONDITION or UNAVAILABLE."""
    unavailable_wait_s: float = Field(5.0, ge=0.0)
    """How long a request waits for a healthy replica before UNAVAILABLE."""
    status_interval_s: float = Field(0.5, gt=0.0)
    """Replica status poll period."""
    status_timeout_s: float = Field(5.0, gt=0.0)
    """Deadline of one replica status poll."""
    min_retry_after_s: float = Field(0.05, ge=0.0)
    """Smallest retry-after a RESOURCE_EXHAUSTED answer suggests."""
    max_sessions: int = Field(100_000, ge=1)
    """Session-affinity map size (LRU)."""
    deployment_max_outstanding: int = Field(0, ge=0)
    """Requests in flight per deployment (0: only per-replica bounds)."""
    replica_host: str = "127.0.0.1"
    """Address each replica's InferenceEngineService binds and reports: 127.0.0.1 (every replica on this
    host), 'node' (the address of the Ray node it runs on: several hosts), or an explicit address."""
    namespace: str = "looprl-inference"
    """Ray namespace of the replicas."""
    watch_runs: bool = True
    """Serve each run in the KV bucket "runs" (needs the bus): start the [[deployments]] of its recipe
    while it is pending, running or stalled (named '<run id>/<name>', serving only that run), and free
    them when it ends. Off, or with `deployments`/`recipe` configured, the router serves only those."""

    @property
    def starts_run_deployments(self) -> bool:
        """Whether each run gets deployments of its own. A router configured with deployments serves
        those to its runs instead: a stack dedicated to one recipe (a benchmark's, a compose file's)."""
        return self.watch_runs and not self.deployments

    @model_validator(mode="after")
    def _resolve_deployments(self) -> RouterConfig:
        if not self.deployments and self.recipe:
            try:
                self.deployments = list(load_recipe(self.recipe).deployments)
            except RecipeError as exc:
                raise field_error("recipe", str(exc)) from None
        names: set[str] = set()
        for i, spec in enumerate(self.deployments):
            if spec.name in names:
                raise field_error(f"deployments[{i}].name", f"duplicate deployment name {spec.name!r}")
            names.add(spec.name)
        return self
