"""One trainer step's batch: group selection (staleness, signal filters), advantages and the pack plan.

Pure functions over groups of `TokenSequence`s; the service decides which groups go into which step
and keeps the bus bookkeeping. `build_step` is deterministic for the same groups (in any order), so a
step planned before a crash is rebuilt identically from the redelivered rollouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from services.rollout_packer.advantages import Estimator, batch_group_advantages, has_signal
from services.rollout_packer.balance import PackPlan, plan_packing
from services.rollout_packer.groups import Group
from services.rollout_packer.packing import PackedMicroBatch, build_micro_batch
from services.rollout_packer.sequences import DropReason, Rejected, TokenSequence


@dataclass(frozen=True)
class PackerSettings:
    """What a run decides about grouping, advantages and packing (from its recipe)."""

    prompts_per_step: int = 8
    group_size: int = 8
    max_staleness: int = 0
    estimator: Estimator = Estimator.GRPO
    eps: float = 1e-6
    filter_zero_variance: bool = True
    min_group_size: int = 2
    straggler_timeout_s: float = 300.0
    max_tokens_per_microbatch: int = 8192
    attention_weight: float = 0.0
    pad_token_id: int = 0
    world_size: int = 1
    samples_every: int = 0  # a samples table every k steps (logging.samples_every); 0: none
    samples_per_step: int = 8
    sample_chars: int = 2000

    def __post_init__(self) -> None:
        object.__setattr__(self, "estimator", Estimator(self.estimator))
        checks = {
            "prompts_per_step": self.prompts_per_step > 0,
            "group_size": self.group_size > 0,
            "max_staleness": self.max_staleness >= 0,
            "min_group_size": self.min_group_size >= 1,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch > 0,
            "attention_weight": self.attention_weight >= 0,
            "world_size": self.world_size > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid packer settings: {', '.join(f'{b}={getattr(self, b)}' for b in bad)}")


def settings_from_recipe(recipe, **overrides) -> PackerSettings:
    """The packer's view of a run recipe (services.kit.config.recipe.Recipe)."""
    values = {
        "prompts_per_step": recipe.groups_per_step,
        "group_size": recipe.batch.group_size,
        "max_staleness": recipe.run.max_staleness,
        "estimator": recipe.algorithm.advantage,
        "filter_zero_variance": recipe.algorithm.filter_equal_rewards,
        "straggler_timeout_s": recipe.algorithm.group_timeout_seconds,
        "max_tokens_per_microbatch": recipe.batch.max_tokens_per_microbatch,
        "world_size": recipe.trainer.world_size,
        "samples_every": recipe.logging.samples_every,
        "samples_per_step": recipe.logging.samples_per_step,
        "sample_chars": recipe.logging.sample_chars,
    }
    values.update(overrides)
    return PackerSettings(**values)


def screen_group(group: Group, settings: PackerSettings) -> tuple[Group | None, list[Rejected]]:
    """Drop a finished group that carries no learning signal (all rewards equal), when configured."""
    if settings.filter_zero_variance and not has_signal(np.array([m.reward for m in group.members])):
        detail = f"group {group.group_id}: all {len(group.members)} rewards equal"
        return None, [
            Rejected(m.rollout_id, DropReason.ZERO_VARIANCE_GROUP, detail, group.group_id)
            for m in group.members
        ]
    return group, []


def filter_stale(
    group: Group, trainer_version: int, settings: PackerSettings
) -> tuple[Group | None, list[Rejected]]:
    """Drop members sampled more than max_staleness versions ago; a group left too small goes too."""
    keep: list[TokenSequence] = []
    drops: list[Rejected] = []
    for m in group.members:
        staleness = trainer_version - m.min_version
        if staleness > settings.max_staleness:
            drops.append(
                Rejected(
                    m.rollout_id,
                    DropReason.STALE,
                    f"staleness {staleness} > {settings.max_staleness}",
                    group.group_id,
                )
            )
        else:
            keep.append(m)
    if not drops:
        return group, []
    if len(keep) < settings.min_group_size:
        detail = (
            f"group {group.group_id}: {len(keep)} fresh samples < min_group_size {settings.min_group_size}"
        )
        drops.extend(Rejected(m.rollout_id, DropReason.GROUP_TOO_SMALL, detail, group.group_id) for m in keep)
        return None, drops
    survivor = Group(group.group_id, keep, partial=True)
    if settings.filter_zero_variance:
        screened, more = screen_group(survivor, settings)
        return screened, drops + more
    return survivor, drops


@dataclass
class StepBatch:
    """A planned step: its sequences, one advantage each, and which rank packs which of them."""

    step: int
    trainer_version: int
    sequences: list[TokenSequence]
    advantages: np.ndarray  # float32 [N], aligned with sequences
    plan: PackPlan
    settings: PackerSettings
    dropped: list[Rejected] = field(default_factory=list)

    @property
    def rollout_ids(self) -> list[str]:
        return [s.rollout_id for s in self.sequences]

    @cached_property
    def global_loss_tokens(self) -> int:
        """Loss tokens of the whole step (all ranks): the denominator of a global token-mean loss."""
        return sum(self.sequences[i].loss_tokens for r in self.plan.bins for b in r for i in b.tolist())

    @cached_property
    def reward_stats(self) -> tuple[float, float]:
        """(mean, std) of the rewards of the step's rollouts, reported with every micro-batch."""
        rewards = np.fromiter((s.reward for s in self.sequences), dtype=np.float64, count=len(self.sequences))
        return (float(rewards.mean()), float(rewards.std())) if rewards.size else (0.0, 0.0)

    @cached_property
    def global_sequences(self) -> int:
        return sum(b.size for r in self.plan.bins for b in r)

    def micro_batch(self, rank: int, index: int) -> PackedMicroBatch:
        idx = self.plan.bins[rank][index].tolist()
        return build_micro_batch(
            [self.sequences[i] for i in idx],
            self.advantages[idx],
            step=self.step,
            rank=rank,
            index=index,
            count=self.plan.micro_batches_per_rank,
            global_loss_tokens=self.global_loss_tokens,
            global_sequences=self.global_sequences,
            pad_token_id=self.settings.pad_token_id,
        )

    def micro_batches(self, rank: int) -> Iterator[PackedMicroBatch]:
        for j in range(self.plan.micro_batches_per_rank):
            yield self.micro_batch(rank, j)


def build_step(
    step: int,
    groups: Sequence[Group],
    trainer_version: int,
    settings: PackerSettings,
    world_size: int | None = None,
) -> StepBatch:
    """Advantages per group, then the pack plan over all sequences of the step."""
    world = world_size or settings.world_size
    ordered = sorted(groups, key=lambda g: g.group_id)
    sequences = [m for g in ordered for m in g.members]
    advantages = batch_group_advantages(
        np.fromiter((s.reward for s in sequences), dtype=np.float64, count=len(sequences)),
        np.fromiter((len(g.members) for g in ordered), dtype=np.int64, count=len(ordered)),
        settings.estimator,
        settings.eps,
    )
    lengths = np.fromiter((s.length for s in sequences), dtype=np.int64, count=len(sequences))
    # Ties (equal lengths) break by the step's canonical order, not by rollout id: rollout ids hash
    # the run id, and which rank sums which sequence must not depend on what the run is called.
    order = np.arange(len(sequences))
    plan = plan_packing(lengths, order, world, settings.max_tokens_per_microbatch, settings.attention_weight)
    dropped = [
        Rejected(
            sequences[i].rollout_id,
            DropReason.TOO_LONG,
            f"{sequences[i].length} tokens > max_tokens_per_microbatch {settings.max_tokens_per_microbatch}",
        )
        for i in plan.too_long.tolist()
    ]
    return StepBatch(step, trainer_version, sequences, advantages, plan, settings, dropped)
