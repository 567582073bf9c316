"""A disaggregated deployment's split, re-tuned by the router at weight-version boundaries from what
its workers measured and the lengths routed to it (the decision is services/decisions/pd_ratio.py's,
tested there; here: what feeds it, when it runs, and how a decision is applied and reported)."""

from __future__ import annotations

from types import SimpleNamespace

from services.decisions.pd_ratio import Ratio
from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.policies import ROLE_DECODE, ROLE_PREFILL, DeploymentState, ReplicaState
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.router import Router
from services.inference_router.split_tuning import SplitTuning, apply_split, measured_rates
from services.kit.config.recipe import DisaggregationSection

SECTION = DisaggregationSection(prefill_workers=2, decode_workers=2, retune_min_requests=8)


class Counters:
    """A worker's cumulative stage counters, advanced as if it ran for a while."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def ran(self, prefill_tokens=0, prefill_s=0.0, decode_batch=0, decode_steps=0, decode_s=0.0):
        f = self.figures
        f["prefill_tokens"] = f.get("prefill_tokens", 0) + prefill_tokens
        f["prefill_seconds"] = f.get("prefill_seconds", 0.0) + prefill_s
        if decode_steps:
            b = 1 << max(0, decode_batch - 1).bit_length()
            f[f"decode_b{b}_steps"] = f.get(f"decode_b{b}_steps", 0) + decode_steps
            f[f"decode_b{b}_tokens"] = f.get(f"decode_b{b}_tokens", 0) + decode_steps * decode_batch
            f[f"decode_b{b}_seconds"] = f.get(f"decode_b{b}_seconds", 0.0) + decode_s
        return dict(f)


def test_stage_speeds_are_what_changed_since_the_last_boundary_over_every_worker():
    a, b = Counters(), Counters()
    before = {
        "w0": a.ran(prefill_tokens=1000, prefill_s=1.0),
        "w1": b.ran(decode_batch=8, decode_steps=10, decode_s=1.0),
    }
    now = {
        "w0": a.ran(prefill_tokens=4000, prefill_s=1.0),
        "w1": b.ran(decode_batch=8, decode_steps=50, decode_s=2.0),
    }
    rates, batch = measured_rates(now, before, max_batch=32)
    assert rates.prefill_tokens_per_s == 4000.0  # the earlier 1000 tokens in 1 s are not counted again
    assert rates.decode_points == ((8.0, 200.0),) and batch == 8.0 and rates.max_decode_batch == 32
    # Nothing decoded since: the decode speed measured before stands.
    later = {"w0": a.ran(prefill_tokens=500, prefill_s=0.5), "w1": dict(now["w1"])}
    kept, _ = measured_rates(later, now, 32, previous=rates)
    assert kept.prefill_tokens_per_s == 1000.0 and kept.decode_points == rates.decode_points
    assert measured_rates(now, now, 32) == (None, 0.0)  # nothing measured, nothing to decide from


def _deployment(prefill=2, decode=2) -> DeploymentState:
    dep = DeploymentState(name="pd", disaggregated=True)
    dep.replicas = [
        ReplicaState(
            name=f"pd-r{i}",
            deployment="pd",
            healthy=True,
            weight_version=0,
            role=ROLE_PREFILL if i < prefill else ROLE_DECODE,
        )
        for i in range(prefill + decode)
    ]
    return dep


def _boundary(split: SplitTuning, dep: DeploymentState, counters, version: int, prompt: int, output: int):
    """One version's worth of traffic: 16 requests of these lengths, prefill at 2,000 tokens/s and
    decode at 100 tokens/s per sequence-slot (batch 8: 800 tokens/s), then every worker at `version`."""
    for _ in range(16):
        split.observe_request(prompt, [output])
    for i, c in enumerate(counters):
        role = dep.replicas[i].role
        figures = (
            c.ran(prefill_tokens=8 * prompt, prefill_s=8 * prompt / 2000)
            if role == ROLE_PREFILL
            else c.ran(decode_batch=8, decode_steps=2 * output, decode_s=2 * output * 8 / 800)
        )
        split.observe_status(dep.replicas[i].name, figures)
    for r in dep.replicas:
        r.weight_version = version
    return split.at_version(dep)


def test_the_split_follows_the_lengths_once_at_a_boundary_and_does_not_flap():
    dep, split = _deployment(), SplitTuning("pd", SECTION, max_batch=8)
    counters = [Counters() for _ in dep.replicas]
    assert split.at_version(dep) is None  # version 0, nothing measured yet
    # Long prompts, short outputs: prefill-bound, so workers move to prefill...
    first = _boundary(split, dep, counters, 1, prompt=2000, output=20)
    assert first.changed and first.ratio.prefill > 2
    assert [r.role for r in dep.replicas].count(ROLE_PREFILL) == first.ratio.prefill
    assert dep.split_decision.startswith(f"{first.ratio} at version 1: ")
    assert metrics.SPLIT_WORKERS.labels("pd", ROLE_PREFILL)._value.get() == first.ratio.prefill
    # ...and stay there while the lengths hold.
    for version in (2, 3, 4):
        again = _boundary(split, dep, counters, version, prompt=2000, output=20)
        assert not again.changed, again.detail
    # Within a version nothing is decided twice.
    assert split.at_version(dep) is None
    # Short prompts, long outputs: decode-bound, workers move back toward decode.
    drifted = _boundary(split, dep, counters, 5, prompt=50, output=400)
    assert drifted.changed and drifted.ratio.prefill < first.ratio.prefill


def test_few_requests_keep_the_split_and_count_toward_the_next_boundary():
    dep, split = _deployment(), SplitTuning("pd", SECTION.model_copy(update={"retune_min_requests": 20}), 8)
    counters = [Counters() for _ in dep.replicas]
    split.at_version(dep)
    assert _boundary(split, dep, counters, 1, prompt=2000, output=20).reason == "too_few_requests"
    assert _boundary(split, dep, counters, 2, prompt=2000, output=20).changed  # 32 requests by now


def test_a_split_written_as_fixed_is_never_moved():
    dep, split = _deployment(), SplitTuning("pd", SECTION.model_copy(update={"retune": False}), 8)
    counters = [Counters() for _ in dep.replicas]
    assert _boundary(split, dep, counters, 1, prompt=2000, output=20) is None
    assert [r.role for r in dep.replicas] == [ROLE_PREFILL, ROLE_PREFILL, ROLE_DECODE, ROLE_DECODE]


def test_the_workers_that_change_stage_are_the_least_busy():
    dep = _deployment(prefill=1, decode=3)
    for replica, load in zip(dep.replicas, (0, 5, 1, 9), strict=True):
        replica.outstanding_requests = load
    apply_split(dep, Ratio(2, 2))
    assert [r.role for r in dep.replicas] == [ROLE_PREFILL, ROLE_DECODE, ROLE_PREFILL, ROLE_DECODE]
    apply_split(dep, Ratio(1, 3))
    assert [r.role for r in dep.replicas] == [ROLE_DECODE, ROLE_DECODE, ROLE_PREFILL, ROLE_DECODE]


async def test_the_router_decides_when_every_routable_worker_serves_a_new_version():
    dep = _deployment()
    router = Router(config=RouterConfig())
    router.add_deployment(dep, [SimpleNamespace(name=r.name) for r in dep.replicas])  # never called here
    split = router.splits["pd"] = SplitTuning("pd", SECTION, 8)
    counters = [Counters() for _ in dep.replicas]
    for _ in range(16):
        split.observe_request(2000, [20])

    def poll(i: int, version: int) -> None:
        role = dep.replicas[i].role
        figures = (
            counters[i].ran(prefill_tokens=16000, prefill_s=8.0)
            if role == ROLE_PREFILL
            else counters[i].ran(decode_batch=8, decode_steps=40, decode_s=0.4)
        )
        status = ReplicaStatus(
            replica=dep.replicas[i].name, weight_version=version, ready=True, engine=figures
        )
        router.observe_status(dep.replicas[i], status)

    for i in range(4):
        poll(i, 0)
    assert split.boundary == 0 and split.last is None  # version 0: the first measurements only
    for i in range(3):
        poll(i, 1)
    assert split.boundary == 0  # one worker still serves version 0
    poll(3, 1)
    assert split.boundary == 1 and split.last is not None and split.last.inputs.weight_version == 1
