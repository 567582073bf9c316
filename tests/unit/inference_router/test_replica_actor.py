"""The replica's Ray actor class: the router imports it without torch, and it exposes every
public method of ReplicaCore, each of the same kind."""

from __future__ import annotations

import inspect
import subprocess
import sys

from services.inference_router import replica_actor
from services.inference_router.replica import ReplicaCore


def test_the_actor_delegates_every_public_method_of_the_core_with_its_kind():
    public = {n: f for n, f in vars(ReplicaCore).items() if callable(f) and not n.startswith("_")}
    assert set(replica_actor.RAY_SURFACE) | set(replica_actor.STREAMING) == set(public)
    for name in replica_actor.RAY_SURFACE:
        assert inspect.iscoroutinefunction(public[name]), name
        assert inspect.iscoroutinefunction(getattr(replica_actor.ReplicaActor, name)), name
    for name in replica_actor.STREAMING:
        assert inspect.isasyncgenfunction(public[name]), name
        assert inspect.isasyncgenfunction(getattr(replica_actor.ReplicaActor, name)), name


def test_the_router_creates_replica_actors_without_importing_torch():
    code = (
        "import sys\n"
        "import services.inference_router.service, services.inference_router.deployments\n"
        "from services.inference_router.replica_actor import InferenceReplica\n"
        "print(sorted(m for m in ('torch', 'services.inference_router.replica') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
