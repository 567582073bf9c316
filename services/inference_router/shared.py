"""Replicas shared by LoRA runs of one base: one set of actors, one view of them per run.

A deployment with `shared = true` in a LoRA run's recipe is started once, as `shared/<name>`: its
replica actors load the base (model_path) once and serve every run's adapter beside it. Each run
still sees a deployment of its own, `<run id>/<name>`, whose replicas are views of the shared
actors: the router routes a run's requests, follows its weight versions and restarts exactly as
for an unshared deployment, weight-sync registers one target per (replica, run) naming the run's
adapter (RegisterTargetRequest.adapter), and a view's status carries the run's adapter version.
Runs join while the replicas have adapter slots (`max_loras`); the last one to end frees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc import errors

SHARED_PREFIX = "shared/"


def shared_name(spec_name: str) -> str:
    """The shared deployment a run's `<run id>/<name>` deployment is a view of."""
    return SHARED_PREFIX + spec_name.rpartition("/")[2]


def _fingerprint(spec: DeploymentSpec) -> dict[str, Any]:
    """What must agree for two runs to share replicas: everything but the run-scoped name."""
    return spec.model_dump(exclude={"name"})


@dataclass
class SharedPool:
    name: str
    spec: DeploymentSpec
    actors: list[Any]
    runs: set[str] = field(default_factory=set)

    def check_joins(self, spec: DeploymentSpec, run_id: str, where: str) -> None:
        if _fingerprint(spec) != _fingerprint(self.spec):
            raise errors.FailedPrecondition(
                f"{where}: shared deployment {self.name!r} runs with other settings (every run that "
                "shares it must declare it alike, model path included)"
            )
        if run_id not in self.runs and len(self.runs) >= self.spec.max_loras:
            raise errors.ResourceExhausted(
                f"{where}.max_loras: shared deployment {self.name!r} holds {len(self.runs)} runs' adapters, "
                f"its {self.spec.max_loras} slots"
            )
