"""Every step fills: which newly sampled groups replace the groups the packer dropped whole.

The packer records each group it drops whole (all rewards equal under `filter_equal_rewards`, as
DAPO's dynamic sampling; too stale under `max_staleness`; a straggler) against the step that was
filling, before acking its rollouts (services/kit/messages/packer_reports.py). The run's driver feeds one
replacement group per drop, so the packer still finds `groups_per_step` groups for every step, up to
`batch.max_resample_batches` steps' worth per step; a step that needs more fails the run with why
its groups were dropped, instead of leaving it to wait for groups that never come.

Drops are numbered per step in the order the packer made them, and the packer fills steps in
order, so the replacements a run was fed are its first `fed` drops in (step, number) order: the one
count in the run record (`extra["resampled_groups"]`) says which are owed, after a restart too.
Replacement (step, i) samples the task at index `steps * groups_per_step + step * limit + i`, past
every index the run's own steps use, with seeds from that index alone, so a synchronous run that
drops the same groups is fed the same replacements: its rewards and losses stay reproducible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from services.kit.config.recipe import Recipe
from services.kit.messages.packer_reports import GroupDrop

# RunRecord.extra key: how many replacement groups the run was fed.
RESAMPLED_KEY = "resampled_groups"

# Why a step's groups kept being dropped, and what to do about it, by the packer's reason.
HINTS = {
    "zero_variance_group": (
        "every sample of a prompt got the same reward (algorithm.filter_equal_rewards): the tasks give "
        "no learning signal to this policy; make them easier or harder, check the reward, or turn the "
        "filter off"
    ),
    "stale": (
        "their rollouts were sampled more than run.max_staleness versions before the step: sampling "
        "does not keep up with training; add replicas or raise run.max_staleness"
    ),
    "group_too_small": (
        "too few of their rollouts were fresh enough (run.max_staleness): sampling does not keep up with "
        "training; add replicas or raise run.max_staleness"
    ),
    "straggler_timeout": (
        "they were still incomplete after algorithm.group_timeout_seconds: episodes fail or hang (the "
        "run's last error says which)"
    ),
}


def owed(drops: Mapping[int, Sequence[GroupDrop]], fed: int, steps: int) -> list[tuple[int, int]]:
    """The (step, i) replacements not fed yet, in feeding order; drops once the run's last step
    filled are owed nothing."""
    order = [(step, i) for step in sorted(drops) if step < steps for i in range(len(drops[step]))]
    return order[fed:]


def refusal(drops: Mapping[int, Sequence[GroupDrop]], recipe: Recipe) -> str | None:
    """Why the run must fail: the first step that dropped more groups than may be replaced."""
    limit = recipe.resampled_groups_per_step
    for step in sorted(drops):
        if step < recipe.run.steps and len(drops[step]) > limit:
            reasons = Counter(d.reason for d in drops[step])
            main = reasons.most_common(1)[0][0]
            counted = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common())
            return (
                f"step {step} cannot fill: the packer dropped {len(drops[step])} groups while it filled "
                f"({counted}; last: {drops[step][-1].detail}), more than the {limit} that "
                f"batch.max_resample_batches = {recipe.batch.max_resample_batches} lets a step replace: "
                f"{HINTS.get(main, 'see the packer log')}"
            )
    return None


def replacement(run_id: str, recipe: Recipe, step: int, i: int) -> tuple[str, int]:
    """(group id, task index) of the i-th replacement group fed while `step` filled."""
    groups = recipe.groups_per_step
    index = recipe.run.steps * groups + step * recipe.resampled_groups_per_step + i
    return f"{run_id}.s{step}.r{i}", index


def per_step(drops: Mapping[int, Sequence[GroupDrop]], step: int) -> int:
    """Groups dropped (and replaced) while `step` filled."""
    return len(drops.get(step, ()))
