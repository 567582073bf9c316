"""Helpers for tests that drive runs through a stack's gateway."""

from __future__ import annotations

import time

from bench.loop_harness import with_overrides  # noqa: F401 - re-exported for tests
from looprl.gateway.v1 import gateway_pb2


def run_to_end(stub, metadata, recipe: str, run_id: str, timeout: float) -> gateway_pb2.Run:
    stub.CreateRun(gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id=run_id), metadata=metadata)
    deadline = time.monotonic() + timeout
    final = None
    for update in stub.WatchRun(
        gateway_pb2.WatchRunRequest(run_id=run_id), metadata=metadata, timeout=timeout
    ):
        final = update.run
        if time.monotonic() > deadline:
            break
    assert final is not None
    assert final.state == gateway_pb2.RUN_STATE_COMPLETED, f"run ended {final.state}: {final.error}"
    return final


def assert_accounting(run: gateway_pb2.Run) -> None:
    """Every rollout published was trained exactly once or dropped for a recorded reason."""
    dropped = sum(run.rollouts_dropped.values())
    assert run.rollouts_trained + dropped == run.episodes_published, (
        f"published {run.episodes_published}, trained {run.rollouts_trained}, dropped {dict(run.rollouts_dropped)}"
    )
    assert [h.step for h in run.history] == list(range(run.total_steps))
