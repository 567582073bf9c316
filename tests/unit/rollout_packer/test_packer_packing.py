"""Pack plans and packed micro-batches on heavy-tailed (log-normal) lengths, checked property-wise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.harness.synthetic_rollouts import lognormal_lengths, make_rollout
from services.rollout_packer.balance import plan_packing
from services.rollout_packer.groups import Group
from services.rollout_packer.sequences import NO_VERSION, sequence_from_rollout
from services.rollout_packer.step import PackerSettings, build_step


@st.composite
def heavy_tailed(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(0, 400))
    max_len = draw(st.sampled_from([256, 2048, 16384]))
    median = draw(st.sampled_from([16.0, 64.0, 200.0, 1000.0]).filter(lambda m: m < max_len))
    lengths = lognormal_lengths(n, np.random.default_rng(seed), median=median, max_len=max_len, min_len=1)
    world = draw(st.integers(1, 8))
    budget = draw(st.integers(int(max_len * 0.6), max_len * 3))
    attention = draw(st.sampled_from([0.0, 1e-4]))
    return lengths, world, budget, attention


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heavy_tailed())
def test_plan_places_every_sequence_once_within_budget_with_equal_counts(case) -> None:
    lengths, world, budget, attention = case
    keys = np.array([f"r{i:05d}" for i in range(lengths.size)], dtype=str)
    plan = plan_packing(lengths, keys, world, budget, attention)
    too_long = set(plan.too_long.tolist())
    assert too_long == set(np.flatnonzero(lengths > budget).tolist())
    placed = np.concatenate([b for rank in plan.bins for b in rank]) if lengths.size else np.zeros(0)
    # every sequence that fits lands in exactly one micro-batch
    assert sorted(placed.tolist()) == sorted(set(range(lengths.size)) - too_long)
    assert len(plan.bins) == world
    assert all(len(rank) == plan.micro_batches_per_rank for rank in plan.bins)
    for r, rank in enumerate(plan.bins):
        for j, b in enumerate(rank):
            assert lengths[b].sum() <= budget
            assert plan.tokens[r, j] == lengths[b].sum()
    # no more micro-batches than first-fit-decreasing needs, rounded up to whole rounds of ranks
    ffd = _first_fit_decreasing_bins(lengths[lengths <= budget], budget)
    assert plan.micro_batches_per_rank <= max(1, -(-ffd // world))


def _first_fit_decreasing_bins(lengths: np.ndarray, budget: int) -> int:
    rooms: list[int] = []
    for n in sorted(lengths.tolist(), reverse=True):
        for k, room in enumerate(rooms):
            if room >= n:
                rooms[k] -= n
                break
        else:
            rooms.append(budget - n)
    return len(rooms)


def test_plan_is_deterministic_and_independent_of_input_order() -> None:
    rng = np.random.default_rng(3)
    lengths = lognormal_lengths(2000, rng, median=500, max_len=8192)
    keys = np.array([f"r{i:05d}" for i in range(lengths.size)], dtype=str)
    a = plan_packing(lengths, keys, 4, 8192)
    perm = rng.permutation(lengths.size)
    b = plan_packing(lengths[perm], keys[perm], 4, 8192)
    ids_a = [[keys[x].tolist() for x in mb] for rank in a.bins for mb in rank]
    ids_b = [[keys[perm][x].tolist() for x in mb] for rank in b.bins for mb in rank]
    assert ids_a == ids_b


def test_heavy_tailed_step_is_balanced_and_nearly_padding_free() -> None:
    lengths = lognormal_lengths(3000, np.random.default_rng(0), median=1000, max_len=16384)
    keys = np.array([f"r{i:05d}" for i in range(lengths.size)], dtype=str)
    plan = plan_packing(lengths, keys, 8, 16384)
    assert plan.rank_imbalance <= 1.02
    assert plan.padding_fraction <= 0.05
    # the j-th micro-batches of all ranks cost about the same: little waiting at each sync
    assert plan.sync_idle_fraction <= 0.02


def test_fewer_sequences_than_ranks_gives_padding_micro_batches() -> None:
    groups = [_group("g0", [5, 9])]
    step = build_step(0, groups, 0, PackerSettings(max_tokens_per_microbatch=64), world_size=4)
    batches = [list(step.micro_batches(r)) for r in range(4)]
    assert {len(b) for b in batches} == {1}
    padding = [mb for rank in batches for mb in rank if mb.is_padding]
    assert len(padding) == 2
    for mb in padding:
        assert mb.num_tokens == 1 and mb.loss_mask.sum() == 0 and mb.cu_seqlens.tolist() == [0, 1]


def _group(
    gid: str, completion_lens: list[int], rewards: list[float] | None = None, version: int = 0
) -> Group:
    rewards = rewards or [float(i % 2) for i in range(len(completion_lens))]
    members = [
        sequence_from_rollout(
            make_rollout(
                f"{gid}-{i}",
                gid,
                prompt_len=3,
                completion_len=n,
                reward=rw,
                group_size=len(completion_lens),
                sample_index=i,
                seed=hash((gid, i)) % 1000,
                version=version,
                env_turn_len=2 if i % 2 else 0,
            )
        )
        for i, (n, rw) in enumerate(zip(completion_lens, rewards, strict=True))
    ]
    return Group(gid, members)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 120), min_size=2, max_size=6), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(130, 400),
)
def test_micro_batches_line_up_with_tokens_masks_and_boundaries(group_lens, world, budget) -> None:
    groups = [_group(f"g{k}", lens) for k, lens in enumerate(group_lens)]
    step = build_step(7, groups, 0, PackerSettings(max_tokens_per_microbatch=budget), world_size=world)
    by_id = {m.rollout_id: m for g in groups for m in g.members}
    adv_by_id = dict(zip(step.rollout_ids, step.advantages.tolist(), strict=True))
    seen: list[str] = []
    for rank in range(world):
        mbs = list(step.micro_batches(rank))
        assert len(mbs) == step.plan.micro_batches_per_rank
        for j, mb in enumerate(mbs):
            assert (mb.step, mb.rank, mb.index, mb.count) == (7, rank, j, len(mbs))
            assert mb.num_tokens <= budget
            t = mb.num_tokens
            for arr in (mb.position_ids, mb.loss_mask, mb.advantages, mb.behaviour_logprobs, mb.versions):
                assert arr.shape == (t,)
            assert mb.cu_seqlens[0] == 0 and mb.cu_seqlens[-1] == t
            if mb.is_padding:
                continue
            assert len(mb.cu_seqlens) == len(mb.rollout_ids) + 1
            for k, rid in enumerate(mb.rollout_ids):
                s, e = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                seq = by_id[rid]
                np.testing.assert_array_equal(mb.input_ids[s:e], seq.input_ids)
                np.testing.assert_array_equal(mb.position_ids[s:e], np.arange(e - s))
                np.testing.assert_array_equal(mb.loss_mask[s:e], seq.loss_mask.astype(np.float32))
                np.testing.assert_array_equal(mb.behaviour_logprobs[s:e], seq.logprobs)
                np.testing.assert_array_equal(mb.versions[s:e], seq.versions)
                np.testing.assert_allclose(mb.advantages[s:e], adv_by_id[rid] * seq.loss_mask)
                assert np.all(mb.behaviour_logprobs[s:e][~seq.loss_mask] == 0)
                assert np.all(mb.versions[s:e][~seq.loss_mask] == NO_VERSION)
            seen.extend(mb.rollout_ids)
    assert sorted(seen) == sorted(by_id)  # every rollout in exactly one micro-batch
    assert mbs[0].global_sequences == len(by_id)
    assert mbs[0].global_loss_tokens == sum(int(s.loss_mask.sum()) for s in by_id.values())


def test_step_advantages_are_per_group() -> None:
    groups = [_group("gA", [4, 4, 4], rewards=[1.0, 0.0, 0.0]), _group("gB", [4, 4], rewards=[0.0, 2.0])]
    step = build_step(0, groups, 0, PackerSettings(estimator="dr_grpo"))
    assert dict(zip(step.rollout_ids, step.advantages.tolist(), strict=True)) == pytest.approx(
        {"gA-0": 2 / 3, "gA-1": -1 / 3, "gA-2": -1 / 3, "gB-0": -1.0, "gB-1": 1.0}
    )


def test_to_torch_shares_dtypes() -> None:
    step = build_step(0, [_group("g", [3, 5])], 0, PackerSettings())
    tensors = next(step.micro_batches(0)).to_torch()
    import torch

    assert tensors["input_ids"].dtype == torch.int32 and tensors["versions"].dtype == torch.int64
    assert tensors["advantages"].dtype == torch.float32
