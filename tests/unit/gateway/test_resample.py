"""Which groups replace the groups the packer dropped whole, and when a run must fail instead."""

from __future__ import annotations

from gateway import resample
from gateway.runs import episode_tasks
from services.kit.config.recipe import RunRecord, parse_recipe
from services.kit.messages.packer_reports import GroupDrop

RECIPE = """
[run]
steps = 5
[batch]
rollouts_per_step = 8
group_size = 2
max_resample_batches = 1
"""


def drops(step: int, count: int, reason: str = "zero_variance_group") -> list[GroupDrop]:
    return [
        GroupDrop(f"r.s{step}.g{i}", reason, f"group r.s{step}.g{i}: all 2 rewards equal")
        for i in range(count)
    ]


def test_replacements_are_owed_in_step_order_after_those_already_fed() -> None:
    dropped = {2: drops(2, 1), 0: drops(0, 2), 7: drops(7, 1)}
    assert resample.owed(dropped, fed=0, steps=5) == [(0, 0), (0, 1), (2, 0)]
    assert resample.owed(dropped, fed=2, steps=5) == [(2, 0)]
    assert resample.owed(dropped, fed=3, steps=5) == []  # step 7 is past the run: nothing owed


def test_replacement_tasks_sample_new_prompts_the_same_in_every_run() -> None:
    recipe = parse_recipe(RECIPE)
    regular = {step * recipe.groups_per_step + g for step in range(5) for g in range(recipe.groups_per_step)}
    limit = recipe.resampled_groups_per_step
    assert limit == recipe.groups_per_step  # one step's worth
    replacements = [resample.replacement("r", recipe, step, i) for step in range(5) for i in range(limit)]
    indices = [index for _, index in replacements]
    assert len(set(indices)) == len(indices) and not set(indices) & regular
    assert len({gid for gid, _ in replacements}) == len(replacements)
    # A pure function of (run, step, i): a run fed the same drops samples the same replacements.
    assert resample.replacement("r", recipe, 3, 2) == replacements[3 * limit + 2]
    record = RunRecord(run_id="r", recipe_toml=RECIPE)
    regular_ids = {task.group_id for step in range(5) for _, task in episode_tasks(record, recipe, step)}
    assert not {gid for gid, _ in replacements} & regular_ids


def test_a_step_that_drops_more_than_it_may_replace_fails_the_run_naming_why() -> None:
    recipe = parse_recipe(RECIPE)
    limit = recipe.resampled_groups_per_step
    assert resample.refusal({1: drops(1, limit)}, recipe) is None
    why = resample.refusal({0: drops(0, 1), 1: drops(1, limit + 1)}, recipe)
    assert why is not None
    assert why.startswith(f"step 1 cannot fill: the packer dropped {limit + 1} groups")
    assert "zero_variance_group" in why and "algorithm.filter_equal_rewards" in why
    assert "batch.max_resample_batches = 1" in why
    stale = resample.refusal({3: drops(3, limit + 1, "stale")}, recipe)
    assert stale is not None and "run.max_staleness" in stale
    # Past the run's last step nothing is owed, so nothing fails.
    assert resample.refusal({5: drops(5, limit + 3)}, recipe) is None


def test_no_replacement_allowed_fails_at_the_first_dropped_group() -> None:
    recipe = parse_recipe(RECIPE.replace("max_resample_batches = 1", "max_resample_batches = 0"))
    assert resample.refusal({0: drops(0, 1)}, recipe) is not None
