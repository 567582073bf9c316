"""Step assembly: staleness and zero-signal filters, and deterministic rebuilds of a step."""

from __future__ import annotations

import numpy as np
import pytest

from bench.harness.synthetic_rollouts import make_rollout
from services.environment_sandbox.agent_loop import rollout_id_for
from services.rollout_packer.groups import Group
from services.rollout_packer.sequences import DropReason, sequence_from_rollout
from services.rollout_packer.step import PackerSettings, build_step, filter_stale, screen_group


def _group(gid: str, rewards: list[float], versions: list[int] | None = None) -> Group:
    versions = versions or [0] * len(rewards)
    return Group(
        gid,
        [
            sequence_from_rollout(
                make_rollout(
                    f"{gid}-{i}",
                    gid,
                    reward=r,
                    version=v,
                    group_size=len(rewards),
                    sample_index=i,
                    completion_len=3 + 7 * i,
                    seed=i,
                )
            )
            for i, (r, v) in enumerate(zip(rewards, versions, strict=True))
        ],
    )


def test_staleness_drops_old_samples_and_counts_them() -> None:
    s = PackerSettings(max_staleness=1, min_group_size=2)
    g, drops = filter_stale(_group("g", [1, 0, 0, 1], versions=[5, 3, 4, 4]), trainer_version=5, settings=s)
    assert [(d.rollout_id, d.reason) for d in drops] == [("g-1", DropReason.STALE)]
    assert "staleness 2 > 1" in drops[0].detail
    assert g is not None and g.rollout_ids == ["g-0", "g-2", "g-3"]


def test_on_policy_keeps_only_current_version() -> None:
    s = PackerSettings(max_staleness=0)
    g, drops = filter_stale(_group("g", [1, 0], versions=[4, 4]), trainer_version=4, settings=s)
    assert g is not None and drops == []
    g, drops = filter_stale(_group("g", [1, 0], versions=[4, 4]), trainer_version=5, settings=s)
    assert g is None and {d.reason for d in drops} == {DropReason.STALE}


def test_a_group_left_too_small_is_dropped_whole() -> None:
    s = PackerSettings(max_staleness=0, min_group_size=2)
    g, drops = filter_stale(_group("g", [1, 0, 1], versions=[2, 1, 1]), trainer_version=2, settings=s)
    assert g is None
    assert sorted((d.rollout_id, d.reason) for d in drops) == [
        ("g-0", DropReason.GROUP_TOO_SMALL),
        ("g-1", DropReason.STALE),
        ("g-2", DropReason.STALE),
    ]


def test_zero_variance_groups_are_filtered_only_when_configured() -> None:
    g, drops = screen_group(_group("g", [1.0, 1.0, 1.0]), PackerSettings(filter_zero_variance=True))
    assert g is None and [d.reason for d in drops] == [DropReason.ZERO_VARIANCE_GROUP] * 3
    g, drops = screen_group(_group("g", [1.0, 1.0, 1.0]), PackerSettings(filter_zero_variance=False))
    assert g is not None and drops == []


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        PackerSettings(max_staleness=-1)
    with pytest.raises(ValueError):
        PackerSettings(estimator="magic")


def test_build_step_is_deterministic_for_any_group_order() -> None:
    groups = [_group(f"g{k}", [float(k % 3), 1.0, 0.0, 0.5]) for k in range(20)]
    s = PackerSettings(max_tokens_per_microbatch=64, estimator="grpo")
    a = build_step(3, groups, 0, s, world_size=3)
    b = build_step(3, list(reversed(groups)), 0, s, world_size=3)
    for rank in range(3):
        for x, y in zip(a.micro_batches(rank), b.micro_batches(rank), strict=True):
            assert x.rollout_ids == y.rollout_ids
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
            np.testing.assert_array_equal(x.advantages, y.advantages)


def test_which_rank_trains_which_sample_does_not_depend_on_the_runs_name() -> None:
    """Rollout ids hash the run id; equal-length samples must still land in the same places, or two
    runs of one recipe and seed sum their losses in different orders and drift apart."""

    def step_of(run_id: str):
        groups = [
            Group(
                f"{run_id}.s0.g{k}",
                [
                    sequence_from_rollout(
                        make_rollout(
                            rollout_id_for(run_id, f"t{k}", f"{run_id}.s0.g{k}", i),
                            f"{run_id}.s0.g{k}",
                            run_id=run_id,
                            group_size=8,
                            sample_index=i,
                            completion_len=4,  # all of one length: every placement is a tie
                            reward=float(i % 2),
                            seed=100 * k + i,
                        )
                    )
                    for i in range(8)
                ],
            )
            for k in range(8)
        ]
        return build_step(0, groups, 0, PackerSettings(max_tokens_per_microbatch=256), world_size=2)

    a, b = step_of("digits-1"), step_of("digits-2")
    for rank in range(2):
        for x, y in zip(a.micro_batches(rank), b.micro_batches(rank), strict=True):
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
            np.testing.assert_array_equal(x.advantages, y.advantages)
