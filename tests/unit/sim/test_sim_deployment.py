"""The deployment simulator: exact step accounting against a hand-computed schedule, the engine's
admission rules, KV hand-offs, and runs in which the tuner itself re-decides the split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from services.decisions.cost_model import GPUS, MODELS, RooflineCost
from services.decisions.pd_ratio import Ratio, TunerPolicy
from sim.deployment import Deployment, WorkerLimits, run_rl
from sim.workload import DriftingLengths, Lengths


@dataclass(frozen=True)
class LinearCost:
    """prefill = 10 ms + 1 ms per prompt token; a decode step = 2 ms + 0.1 ms per sequence + 1 us per
    context token; KV moves at 1 ms per 100 tokens."""

    name: str = "linear"
    source: str = "test"

    def prefill_seconds(self, prompt_lengths: Sequence[int]) -> float:
        return 0.010 + 0.001 * sum(prompt_lengths)

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        return 0.002 + 0.0001 * batch + 1e-6 * context_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        return 0.00001 * tokens


COST = LinearCost()


def step(batch: int, context: int) -> float:
    return COST.decode_step_seconds(batch, context)


def test_one_request_costs_a_prefill_and_one_decode_step_per_further_token():
    (r,) = Deployment(COST, WorkerLimits(), colocated=1).serve([(0.0, 10, [5])]).requests
    # Step 1: prefill (first token), then one decode step over 11 tokens; then 3 steps of 12..14.
    expected = 0.020 + sum(step(1, 10 + k) for k in range(1, 5))
    assert r.first_token_at == pytest.approx(0.020)
    assert r.done_at == pytest.approx(expected)


def test_a_request_arriving_mid_batch_joins_at_the_next_step_boundary():
    arrivals = [(0.0, 10, [200]), (0.1, 10, [3])]
    first, second = Deployment(COST, WorkerLimits(), colocated=1).serve(arrivals).requests
    # The schedule step by step: the first request's steps until the boundary after 0.1 s.
    t, generated = 0.020, 1
    while t < 0.1:
        generated += 1
        t += step(1, 10 + generated - 1)
    boundary = t
    assert second.first_token_at == pytest.approx(boundary + 0.020)
    # Then both decode together: the second needs 2 more tokens.
    both = step(2, 10 + generated + 10 + 1) + step(2, 10 + generated + 1 + 10 + 2 + 1)
    assert second.done_at == pytest.approx(boundary + 0.020 + both, rel=1e-3)
    assert first.done_at > second.done_at and first.output == 200


def test_admission_follows_the_engine_slots_prefill_budget_and_groups():
    limits = WorkerLimits(max_batch=4, max_prefill_tokens=25)
    # Groups of 2 samples: two groups fill the 4 slots; the prompt budget (prompt x samples) admits
    # the second group only within 25 tokens, so the first step prefills one group alone.
    groups = [(0.0, 10, [4, 4]), (0.0, 10, [4, 4]), (0.0, 10, [4, 4])]
    result = Deployment(COST, limits, colocated=1).serve(groups)
    firsts = sorted({round(r.first_token_at, 6) for r in result.requests})
    assert len(firsts) == 3  # three separate prefills
    worker = result.workers[0]
    assert worker.stats.prefill_tokens == 30  # each group's shared prompt prefilled once
    assert all(r.done_at > r.first_token_at for r in result.requests)


def test_disaggregated_requests_hand_their_kv_to_the_least_loaded_decode_worker():
    arrivals = [(0.0, 100, [4]) for _ in range(6)]
    result = Deployment(COST, WorkerLimits(max_batch=8), ratio=Ratio(1, 2)).serve(arrivals)
    prefill, *decoders = result.workers
    assert prefill.stats.prefill_tokens == 600 and prefill.stats.decode_tokens == 0
    assert [d.stats.prefill_tokens for d in decoders] == [0, 0]
    # Every request decoded its 3 tokens after the first on one of the two decode workers, evenly.
    assert sum(d.stats.decode_tokens for d in decoders) == 6 * 3
    assert decoders[0].stats.decode_tokens == decoders[1].stats.decode_tokens
    # One prefill of all six prompts (within the default budget), then a 1 ms KV hand-off each.
    assert all(r.first_token_at == pytest.approx(0.610) for r in result.requests)
    assert min(r.done_at for r in result.requests) > 0.610 + 0.001


def test_a_single_token_request_never_reaches_a_decode_worker():
    result = Deployment(COST, WorkerLimits(), ratio=Ratio(1, 1)).serve([(0.0, 10, [1])])
    assert result.requests[0].done_at == pytest.approx(0.020)
    assert result.workers[1].stats.decode_steps == 0


def test_the_deployment_refuses_an_impossible_split():
    with pytest.raises(ValueError, match="at least one worker of each stage"):
        Deployment(COST, WorkerLimits(), ratio=Ratio(0, 3))
    with pytest.raises(ValueError, match="either"):
        Deployment(COST, WorkerLimits(), colocated=2, ratio=Ratio(1, 1))


H100 = RooflineCost(GPUS["H100"], MODELS["qwen2.5-7b"])
AGENT = DriftingLengths("agent", Lengths(2000, 800), Lengths(32000, 250), 1, 4)


def _run(mode: str, start: Ratio | None = None):
    return run_rl(
        H100,
        AGENT,
        steps=8,
        groups_per_step=64,
        group_size=1,
        workers=8,
        limits=WorkerLimits(max_batch=256, max_prefill_tokens=16384, kv_tokens=H100.kv_capacity_tokens()),
        mode=mode,
        policy=TunerPolicy(min_requests=32),
        start=start,
    )


def test_a_tuned_run_follows_the_drift_and_a_fixed_one_keeps_its_first_split():
    fixed, tuned = _run("fixed"), _run("tuned")
    assert len(set(fixed.ratios)) == 1 and fixed.ratios[0] == tuned.ratios[0]
    moves = [s.decision for s in tuned.steps if s.decision is not None and s.decision.changed]
    assert moves and all(d.ratio.prefill > d.inputs.current.prefill for d in moves)  # contexts grew
    assert all(s.decision.inputs.weight_version == s.step + 1 for s in tuned.steps)
    assert tuned.tokens_per_s > fixed.tokens_per_s
    assert fixed.output_tokens == tuned.output_tokens  # the same requests, served at another speed


def test_a_split_set_by_hand_is_kept_when_fixed_and_left_when_tuned():
    even = _run("fixed", Ratio(4, 4))
    assert set(even.ratios) == {"4:4"}
    tuned = _run("tuned", Ratio(1, 7))  # far too few prefill workers for contexts that grow
    assert tuned.ratios[0] == "1:7" and tuned.steps[-1].ratio.prefill > 1
    assert tuned.tokens_per_s > _run("fixed", Ratio(1, 7)).tokens_per_s
    with pytest.raises(ValueError, match="at least one of each stage"):
        _run("fixed", Ratio(8, 0))


def test_the_same_seed_gives_the_same_workload_and_result():
    a, b = _run("tuned"), _run("tuned")
    assert a.tokens_per_s == b.tokens_per_s and a.ratios == b.ratios
    groups = AGENT.groups(3, 4, 2, seed=1)
    assert groups == AGENT.groups(3, 4, 2, seed=1) != AGENT.groups(3, 4, 2, seed=2)
    assert all(len(outs) == 2 for _, outs in groups)
