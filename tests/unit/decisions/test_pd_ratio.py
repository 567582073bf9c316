"""The P:D ratio tuner: ratios follow the stage costs, drift re-tunes once (never back and forth),
moves are bounded and happen only at weight-version boundaries on enough evidence."""

from __future__ import annotations

import itertools
import json
import random

from services.decisions.cost_model import (
    GPUS,
    MODELS,
    RooflineCost,
    decode_tokens_per_s,
    prefill_tokens_per_s,
)
from services.decisions.pd_ratio import (
    REASON_BOUNDED,
    REASON_FEW_REQUESTS,
    REASON_HYSTERESIS,
    REASON_INITIAL,
    REASON_NOT_BOUNDARY,
    REASON_REBALANCED,
    LengthStats,
    Ratio,
    StageRates,
    TunerPolicy,
    TuningInputs,
    throughput,
    tune,
)

H100_7B = RooflineCost(GPUS["H100"], MODELS["qwen2.5-7b"])


def rates_for(
    cost, prompt: float, output: float, max_batch: int = 128, prefill_scale: float = 1.0
) -> StageRates:
    """What a deployment would measure on this cost model at these lengths."""
    context = int(prompt + output / 2)
    points = tuple(
        (b, decode_tokens_per_s(cost, b, context)) for b in (1, 8, 32, 64, 128, 256) if b <= max_batch
    )
    return StageRates(prefill_tokens_per_s(cost, int(prompt), 4) * prefill_scale, points, max_batch)


def inputs(prompt, output, version=1, current=None, workers=8, requests=512, rates=None) -> TuningInputs:
    return TuningInputs(
        "d",
        version,
        workers,
        current,
        LengthStats(requests, prompt, output),
        rates or rates_for(H100_7B, prompt, output),
    )


def test_short_prompts_long_outputs_want_fewer_prefill_workers_than_long_prompts_short_outputs():
    math_like = tune(inputs(prompt=300, output=4000))  # reasoning: long outputs
    agent_like = tune(inputs(prompt=12000, output=200))  # long accumulated contexts, short turns
    assert math_like.reason == agent_like.reason == REASON_INITIAL
    assert math_like.ratio.prefill < agent_like.ratio.prefill
    assert math_like.ratio == Ratio(1, 7) and agent_like.ratio.prefill >= 4
    # The chosen split is the best the budget allows, and balances better than its neighbours.
    for decision in (math_like, agent_like):
        best = throughput(decision.ratio, decision.inputs).requests_per_s
        for p in range(1, 8):
            assert throughput(Ratio(p, 8 - p), decision.inputs).requests_per_s <= best + 1e-9


def test_the_measured_stage_costs_move_the_ratio_their_way():
    prompt, output = 3000, 600
    base = tune(inputs(prompt, output))
    slow_prefill = tune(inputs(prompt, output, rates=rates_for(H100_7B, prompt, output, prefill_scale=0.25)))
    fast_prefill = tune(inputs(prompt, output, rates=rates_for(H100_7B, prompt, output, prefill_scale=4.0)))
    assert slow_prefill.ratio.prefill > base.ratio.prefill > fast_prefill.ratio.prefill


def _noisy(rng: random.Random, value: float) -> float:
    return value * rng.uniform(0.95, 1.05)


def test_a_drift_retunes_once_and_never_back_and_forth():
    rng = random.Random(0)
    policy = TunerPolicy(max_move=8)
    last = None
    changes = []
    for version in range(1, 41):
        prompt, output = (300, 4000) if version <= 15 else (9000, 300)
        prompt, output = _noisy(rng, prompt), _noisy(rng, output)
        current = last.ratio if last else None
        last = tune(inputs(prompt, output, version, current), policy, last)
        if last.changed:
            changes.append((version, last.ratio, last.reason))
    (start, *moves) = changes
    assert start[0] == 1 and start[2] == REASON_INITIAL
    assert len(moves) == 1, moves
    version, ratio, reason = moves[0]
    assert version == 16 and reason == REASON_REBALANCED and ratio.prefill > start[1].prefill


def test_bounded_moves_walk_monotonically_to_the_target():
    policy = TunerPolicy(max_move=1)
    last = tune(inputs(300, 4000, version=1), policy)
    path = [last.ratio.prefill]
    for version in range(2, 20):
        last = tune(inputs(9000, 300, version, last.ratio), policy, last)
        path.append(last.ratio.prefill)
    steps = [b - a for a, b in itertools.pairwise(path)]
    assert all(s in (0, 1) for s in steps)  # one worker at a time, one direction
    assert path[-1] == last.best.prefill and path[-1] > path[0]
    assert steps.count(1) == path[-1] - path[0]


def test_no_decision_inside_a_version_on_little_evidence_or_for_a_small_gain():
    first = tune(inputs(300, 4000, version=3))
    same_version = tune(inputs(9000, 300, version=3, current=first.ratio), last=first)
    assert same_version.reason == REASON_NOT_BOUNDARY and not same_version.changed
    few = tune(inputs(9000, 300, version=4, current=first.ratio, requests=10), last=first)
    assert few.reason == REASON_FEW_REQUESTS and few.ratio == first.ratio
    # A best split only 7% better than the current one is not worth a move: hold 14:16 of 30
    # workers when 15:15 balances two equally fast stages.
    flat = StageRates(1000.0, ((1, 1000.0),), 64)
    near = tune(inputs(100, 100, version=5, current=Ratio(14, 16), workers=30, rates=flat), last=first)
    assert near.reason == REASON_HYSTERESIS and near.ratio == Ratio(14, 16) and near.best == Ratio(15, 15)
    assert near.current_requests_per_s == 140.0


def test_a_bounded_move_says_so_and_every_decision_logs_its_inputs():
    first = tune(inputs(300, 4000, version=1, workers=16))
    moved = tune(
        inputs(12000, 200, version=2, current=first.ratio, workers=16), TunerPolicy(max_move=1), first
    )
    assert moved.reason == REASON_BOUNDED and moved.ratio.prefill == first.ratio.prefill + 1
    log = moved.as_log()
    json.dumps(log)  # plain values only
    assert log["ratio"] == str(moved.ratio) and log["inputs"]["lengths"]["mean_prompt_tokens"] == 12000
    assert log["inputs"]["weight_version"] == 2 and "req/s" in log["detail"]
