"""The router's side of the P:D tuner: lengths observed per deployment between versions, a decision
at each version boundary, logged with every input and exported as metrics."""

from __future__ import annotations

import json
import logging

from prometheus_client import REGISTRY

from services.decisions.cost_model import GPUS, MODELS, RooflineCost
from services.decisions.pd_ratio import (
    REASON_FEW_REQUESTS,
    REASON_INITIAL,
    REASON_NOT_BOUNDARY,
    REASON_REBALANCED,
    LengthStats,
    TunerPolicy,
    rates_from_cost_model,
)
from services.inference_router.pd_tuning import RatioTuning

COST = RooflineCost(GPUS["H100"], MODELS["qwen2.5-7b"])


def _rates(prompt: float, output: float):
    return rates_from_cost_model(COST, LengthStats(1, prompt, output), 256, COST.kv_capacity_tokens())


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_decisions_follow_the_lengths_served_between_version_boundaries(caplog):
    tuning = RatioTuning(TunerPolicy(min_requests=32, max_move=8))
    caplog.set_level(logging.INFO, logger="looprl.inference_router.pd_tuning")
    for _ in range(40):
        tuning.observe("run/mix", 300, [4000])
    first = tuning.decide("run/mix", 1, 8, _rates(300, 4000), in_flight=256)
    assert first.reason == REASON_INITIAL and first.inputs.lengths.requests == 40
    assert _value("looprl_router_pd_workers", deployment="run/mix", stage="decode") == first.ratio.decode
    # The same version again changes nothing and keeps what was observed since.
    for _ in range(20):
        tuning.observe("run/mix", 12000, [200])
    again = tuning.decide("run/mix", 1, 8, _rates(12000, 200), in_flight=256)
    assert again.reason == REASON_NOT_BOUNDARY and again.ratio == first.ratio
    few = tuning.decide("run/mix", 2, 8, _rates(12000, 200), in_flight=256)
    assert few.reason == REASON_FEW_REQUESTS and few.inputs.lengths.requests == 20
    for _ in range(20):
        tuning.observe("run/mix", 12000, [200])
    moved = tuning.decide("run/mix", 3, 8, _rates(12000, 200), in_flight=256)
    assert moved.reason == REASON_REBALANCED and moved.ratio.prefill > first.ratio.prefill
    assert moved.inputs.lengths.requests == 40  # both windows of long prompts, none of the first
    assert tuning.current("run/mix") == moved.ratio
    assert _value("looprl_router_pd_decisions_total", deployment="run/mix", reason=REASON_REBALANCED) == 1.0
    assert _value("looprl_router_pd_workers", deployment="run/mix", stage="prefill") == moved.ratio.prefill
    chosen = _value("looprl_router_pd_predicted_requests_per_second", deployment="run/mix", split="chosen")
    assert chosen == moved.chosen_requests_per_s > moved.current_requests_per_s
    # Every decision is one log line holding its inputs.
    logged = [json.loads(r.getMessage().split(" ", 3)[3]) for r in caplog.records]
    assert [d["reason"] for d in logged] == [
        REASON_INITIAL,
        REASON_NOT_BOUNDARY,
        REASON_FEW_REQUESTS,
        REASON_REBALANCED,
    ]
    assert logged[-1]["inputs"]["lengths"]["mean_prompt_tokens"] == 12000
    assert logged[-1]["inputs"]["rates"]["prefill_tokens_per_s"] > 0


def test_a_deployment_that_ends_leaves_no_series_behind():
    tuning = RatioTuning()
    tuning.decide("run/gone", 1, 4, _rates(1000, 1000))
    assert _value("looprl_router_pd_workers", deployment="run/gone", stage="prefill") is not None
    tuning.forget("run/gone")
    assert _value("looprl_router_pd_workers", deployment="run/gone", stage="prefill") is None
    assert tuning.current("run/gone") is None
