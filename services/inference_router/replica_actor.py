"""`InferenceReplica`: the replica as a Ray actor class, importable without torch.

The router creates replica actors from this class; only the actor's own process imports
`ReplicaCore` (replica.py: torch, the engine). Importing the engine in the router cost its start-up
seconds of CPU that the replicas it was about to start needed. Each method of the Ray surface
delegates to the core; `RAY_SURFACE` names them and tests check it against `ReplicaCore`.
"""

from __future__ import annotations

from typing import Any

# ReplicaCore's public coroutine methods, and (STREAMING) its async generators.
RAY_SURFACE = (
    "start",
    "shutdown",
    "load_state_dict",
    "stage_weights",
    "commit_weights",
    "rollback_weights",
    "abort_weights",
    "drop_adapter",
    "generate_proto",
    "generate",
    "address",
    "ready",
    "status",
    "pause",
    "resume",
)
STREAMING = ("stream_proto", "generate_stream")


class ReplicaActor:
    def __init__(self, **kwargs: Any) -> None:
        from services.inference_router.replica import ReplicaCore

        self.core = ReplicaCore(**kwargs)


def _call(name: str):
    async def method(self: ReplicaActor, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.core, name)(*args, **kwargs)

    method.__name__, method.__qualname__ = name, f"ReplicaActor.{name}"
    return method


def _stream(name: str):
    async def method(self: ReplicaActor, *args: Any, **kwargs: Any) -> Any:
        async for item in getattr(self.core, name)(*args, **kwargs):
            yield item

    method.__name__, method.__qualname__ = name, f"ReplicaActor.{name}"
    return method


for _name in RAY_SURFACE:
    setattr(ReplicaActor, _name, _call(_name))
for _name in STREAMING:
    setattr(ReplicaActor, _name, _stream(_name))

_actor_class: Any = None


def __getattr__(name: str) -> Any:
    """`InferenceReplica`, created on first use (ray is imported lazily)."""
    global _actor_class
    if name == "InferenceReplica":
        if _actor_class is None:
            import ray

            _actor_class = ray.remote(max_concurrency=1000)(ReplicaActor)
        return _actor_class
    raise AttributeError(name)
