"""Advantage estimators on hand-checked groups; grouping with the straggler timeout policy."""

from __future__ import annotations

import numpy as np
import pytest

from bench.harness.synthetic_rollouts import make_rollout
from services.rollout_packer.advantages import group_advantages, has_signal, per_token_advantages
from services.rollout_packer.groups import GroupCollector
from services.rollout_packer.sequences import DropReason, sequence_from_rollout


def test_grpo_is_mean_centred_and_std_normalised() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, std (ddof=0) 0.5
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), "grpo", eps=0.0)
    np.testing.assert_allclose(adv, [1, -1, -1, 1])
    adv = group_advantages(np.array([3.0, 0.0, 0.0]), "grpo", eps=1e-6)
    std = np.sqrt(((3 - 1) ** 2 + 1 + 1) / 3)
    np.testing.assert_allclose(adv, [2 / (std + 1e-6), -1 / (std + 1e-6), -1 / (std + 1e-6)], rtol=1e-6)


def test_dr_grpo_is_mean_only() -> None:
    np.testing.assert_allclose(group_advantages(np.array([3.0, 0.0, 0.0]), "dr_grpo"), [2, -1, -1])


def test_rloo_uses_the_mean_of_the_others() -> None:
    # r = [3, 0, 0]: 3 - 0 = 3; 0 - 1.5 = -1.5; 0 - 1.5 = -1.5
    np.testing.assert_allclose(group_advantages(np.array([3.0, 0.0, 0.0]), "rloo"), [3, -1.5, -1.5])
    np.testing.assert_allclose(group_advantages(np.array([2.0]), "rloo"), [0.0])


def test_equal_rewards_have_no_signal_and_zero_advantage() -> None:
    assert not has_signal(np.array([1.0, 1.0, 1.0]))
    assert has_signal(np.array([1.0, 1.0, 0.5]))
    for est in ("grpo", "dr_grpo", "rloo"):
        np.testing.assert_allclose(group_advantages(np.array([0.7, 0.7]), est), 0.0, atol=1e-6)


def test_unknown_estimator_is_refused() -> None:
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, 0.0]), "ppo-magic")


def test_per_token_advantages_respect_the_mask() -> None:
    mask = np.array([False, False, True, True, False, True])
    np.testing.assert_array_equal(per_token_advantages(-0.5, mask), [0, 0, -0.5, -0.5, 0, -0.5])


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _seq(rid: str, gid: str, size: int = 3, index: int = 0):
    return sequence_from_rollout(make_rollout(rid, gid, group_size=size, sample_index=index))


def test_groups_complete_in_order_and_members_are_sorted() -> None:
    c = GroupCollector(straggler_timeout_s=10, clock=_Clock())
    for rid, gid, idx in [("a2", "A", 2), ("b0", "B", 0), ("a0", "A", 0), ("b1", "B", 1), ("a1", "A", 1)]:
        assert c.add(_seq(rid, gid, index=idx)) is None
    assert c.add(_seq("b2", "B", index=2)) is None
    ready = c.take_ready()
    assert [g.group_id for g in ready] == ["A", "B"]
    assert ready[0].rollout_ids == ["a0", "a1", "a2"]
    assert c.take_ready() == []


def test_duplicates_and_late_samples_are_dropped() -> None:
    c = GroupCollector(straggler_timeout_s=10, clock=_Clock())
    assert c.add(_seq("a0", "A", size=2)) is None
    assert c.add(_seq("a0", "A", size=2)).reason is DropReason.DUPLICATE
    assert c.add(_seq("a1", "A", size=2, index=1)) is None
    assert c.add(_seq("a9", "A", size=2, index=9)).reason is DropReason.LATE


def test_stragglers_keep_big_enough_partial_groups_and_drop_the_rest() -> None:
    clock = _Clock()
    c = GroupCollector(straggler_timeout_s=10, min_group_size=2, clock=clock)
    c.add(_seq("a0", "A", size=4))
    c.add(_seq("a1", "A", size=4, index=1))
    clock.t = 5
    c.add(_seq("b0", "B", size=4))
    clock.t = 10
    partial, drops = c.expire()
    assert [g.group_id for g in partial] == ["A"] and partial[0].partial
    assert drops == []
    clock.t = 15
    partial, drops = c.expire()
    assert partial == [] and [(d.rollout_id, d.reason) for d in drops] == [
        ("b0", DropReason.STRAGGLER_TIMEOUT)
    ]
    assert [g.group_id for g in c.take_ready()] == ["A"]
    assert c.add(_seq("a2", "A", size=4, index=2)).reason is DropReason.LATE
    assert c.open_groups == 0


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_batched_advantages_equal_per_group_ones(estimator) -> None:
    from services.rollout_packer.advantages import batch_group_advantages

    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 9, 50)
    rewards = rng.random(sizes.sum()).round(1)
    expected = np.concatenate(
        [
            group_advantages(rewards[s - n : s], estimator)
            for s, n in zip(np.cumsum(sizes), sizes, strict=True)
        ]
    )
    np.testing.assert_allclose(
        batch_group_advantages(rewards, sizes, estimator), expected, rtol=1e-5, atol=1e-6
    )
