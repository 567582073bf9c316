"""End to end: every service as its own process (real nats-server, Ray head, gRPC), driven through
the gateway exactly as `looprl run` does. One stack serves every run of this module.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from looprl.gateway.v1 import gateway_pb2

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = (ROOT / "configs" / "digits_grpo.toml").read_text()

pytestmark = pytest.mark.slow

# Mean reward of the last 5 steps over the first 3, for the default recipe and seed.
LEARNING_MARGIN = 0.04


def with_overrides(recipe: str, **sections: dict[str, object]) -> str:
    """The recipe with `key = value` lines replaced inside the named sections."""
    for section, values in sections.items():
        for key, value in values.items():
            pattern = rf"(\[{section}\][^\[]*?^){key} = .*?$"
            literal = repr(value).replace("'", '"') if not isinstance(value, bool) else str(value).lower()
            recipe, count = re.subn(pattern, rf"\g<1>{key} = {literal}", recipe, flags=re.M | re.S)
            assert count == 1, f"{section}.{key} not found in the recipe"
    return recipe


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


def test_default_recipe_learns_and_accounts_for_every_rollout(fresh_stack) -> None:
    stack = fresh_stack
    run = run_to_end(stack.stub, stack.metadata, DEFAULT_RECIPE, "e2e-sync", timeout=600)
    assert_accounting(run)
    rewards = [h.reward_mean for h in run.history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert last > first + LEARNING_MARGIN, (
        f"reward did not go up enough: first 3 steps {first:.3f}, last 5 {last:.3f}"
    )
    assert all(h.max_staleness == 0 for h in run.history)
    assert run.deployments, "no deployment reported a weight version"
    for deployment in run.deployments:
        assert deployment.version >= run.total_steps - 1, (
            f"{deployment.deployment} stuck at v{deployment.version}"
        )


def test_async_run_never_trains_staler_than_its_bound(fresh_stack) -> None:
    stack = fresh_stack
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": 8, "max_staleness": 2})
    run = run_to_end(stack.stub, stack.metadata, recipe, "e2e-async", timeout=300)
    assert_accounting(run)
    assert max(h.max_staleness for h in run.history) <= 2
    assert run.weight_version == 8
