"""The same recipe and seed give the same run: two stacks, each started afresh, train the default recipe
synchronously as two differently named runs and agree bit for bit on every step's reward and loss and
on the exported weights, however the rollouts happened to reach the packer or the engine's batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.runs import assert_accounting, run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE, local_stack

pytestmark = pytest.mark.slow

STEPS = 30


def _train(state_dir: Path, run_id: str) -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": STEPS})
    state_dir.mkdir()
    with local_stack(state_dir) as stack:
        run = run_to_end(stack.stub, stack.metadata, recipe, run_id, timeout=300)
    assert_accounting(run)
    curve = [(h.reward_mean, h.reward_std, h.loss) for h in sorted(run.history, key=lambda h: h.step)]
    (export,) = (state_dir / "trainer" / run_id / "hf").glob("step_*/model.safetensors")
    return curve, load_file(export)


def test_same_recipe_and_seed_give_the_same_rewards_losses_and_weights(tmp_path: Path) -> None:
    # Two names: rollout ids hash the run id, and nothing trained may depend on them.
    first_curve, first_weights = _train(tmp_path / "a", "repro-a")
    second_curve, second_weights = _train(tmp_path / "b", "repro-second")

    assert len(first_curve) == STEPS
    differing = [step for step, (a, b) in enumerate(zip(first_curve, second_curve, strict=True)) if a != b]
    assert not differing, (
        f"steps {differing[:5]} differ: {[first_curve[s] for s in differing[:2]]} vs "
        f"{[second_curve[s] for s in differing[:2]]}"
    )
    assert first_weights.keys() == second_weights.keys()
    unequal = [name for name in first_weights if not torch.equal(first_weights[name], second_weights[name])]
    assert not unequal, f"exported weights differ in {unequal[:4]}"
    # The run trained: a curve of constant values would pass trivially.
    assert len({reward for reward, _, _ in first_curve}) > 1
