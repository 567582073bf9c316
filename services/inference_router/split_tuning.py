"""A disaggregated deployment's prefill:decode split, re-tuned at weight-version boundaries.

The decision itself is services/decisions/pd_ratio.py's `tune` (pure; the deployment simulator in
sim/ calls the same function). This module feeds it and applies what it decides:

- lengths: every request the router finishes on the deployment adds its prompt tokens and its
  output tokens (summed over its completions) since the last decision;
- stage speeds, measured by the workers themselves (the engine's stage counters in each replica's
  status, engine/scheduler.py `StageStats`): prompt tokens per busy second of prefill (prefill and,
  on a prefill worker, writing the KV out), and per decode batch-size bucket, output tokens per
  busy second at the bucket's mean batch. Each boundary takes what changed since the previous one,
  over every worker (a worker's speed at a stage is the hardware's, whichever stage it serves now);
  a stage nobody ran since keeps its last measurement;
- the boundary: every routable worker serves a version newer than the last decided one. Requests
  in flight finish where they are; only the requests routed after the move see the new split, and
  each of them runs its prefill and decode at one version (two_phase.py, engine/disaggregated.py);
- applying a move: the workers that change stage are the ones with the fewest requests in flight
  (a decode worker that becomes a prefill worker first decodes what it holds);
- reporting: every decision is logged with all its inputs (`RatioDecision.as_log()`), counted by
  reason, shown in ListDeployments (`split_decision`), and the workers per stage and the stage
  speeds it used are gauges.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.decisions.pd_ratio import (
    REASON_FEW_REQUESTS,
    REASON_NOT_BOUNDARY,
    REASON_TOO_SOON,
    LengthStats,
    Ratio,
    RatioDecision,
    StageRates,
    TunerPolicy,
    TuningInputs,
    tune,
)
from services.inference_router import metrics
from services.inference_router.policies import ROLE_DECODE, ROLE_PREFILL, DeploymentState
from services.kit.config.recipe import DisaggregationSection

log = logging.getLogger("looprl.inference_router.split")

# Decisions that leave the lengths observed so far to count toward the next one.
_KEEP_LENGTHS = frozenset({REASON_NOT_BOUNDARY, REASON_TOO_SOON, REASON_FEW_REQUESTS})


@dataclass
class _Lengths:
    prompts: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    completions: int = 0

    def stats(self) -> LengthStats:
        per_request = self.completions / max(1, len(self.outputs))
        return LengthStats.of(self.prompts, self.outputs, per_request)


def _delta(now: Mapping[str, float], before: Mapping[str, float], key: str) -> float:
    return max(0.0, float(now.get(key, 0.0)) - float(before.get(key, 0.0)))


def measured_rates(
    now: Mapping[str, Mapping[str, float]],
    before: Mapping[str, Mapping[str, float]],
    max_batch: int,
    previous: StageRates | None = None,
) -> tuple[StageRates | None, float]:
    """Stage speeds from the workers' stage counters (replica -> engine status figures) between two
    boundaries, and the mean decode batch; a stage no worker ran keeps `previous`'s speed."""
    prefill_tokens = prefill_seconds = 0.0
    buckets: dict[int, list[float]] = {}
    for replica, figures in now.items():
        old = before.get(replica, {})
        prefill_tokens += _delta(figures, old, "prefill_tokens")
        prefill_seconds += _delta(figures, old, "prefill_seconds") + _delta(figures, old, "kv_export_seconds")
        for key in figures:
            if key.startswith("decode_b") and key.endswith("_steps"):
                bucket = key[len("decode_b") : -len("_steps")]
                acc = buckets.setdefault(int(bucket), [0.0, 0.0, 0.0])
                for i, what in enumerate(("steps", "tokens", "seconds")):
                    acc[i] += _delta(figures, old, f"decode_b{bucket}_{what}")
    prefill = prefill_tokens / prefill_seconds if prefill_seconds > 0 else 0.0
    points = tuple(
        sorted(
            (tokens / steps, tokens / seconds)
            for steps, tokens, seconds in buckets.values()
            if steps and seconds
        )
    )
    steps = sum(b[0] for b in buckets.values())
    mean_batch = sum(b[1] for b in buckets.values()) / steps if steps else 0.0
    if previous is not None:
        prefill = prefill or previous.prefill_tokens_per_s
        points = points or previous.decode_points
    if not prefill or not points:
        return None, mean_batch
    return StageRates(prefill, points, max_batch), mean_batch


class SplitTuning:
    """The split tuning of one disaggregated deployment."""

    def __init__(self, deployment: str, section: DisaggregationSection, max_batch: int) -> None:
        self.deployment = deployment
        self.enabled = section.retune
        self.max_batch = max_batch
        self.policy = TunerPolicy(min_gain=section.retune_min_gain, min_requests=section.retune_min_requests)
        self.lengths = _Lengths()
        self.figures: dict[str, dict[str, float]] = {}  # replica -> its latest stage counters
        self._at_last: dict[str, dict[str, float]] = {}  # ... as they were at the last boundary
        self.rates: StageRates | None = None
        self.last: RatioDecision | None = None
        self.boundary = -1  # the last version decided at (or passed without measurements)

    def observe_request(self, prompt_tokens: int, completion_tokens: list[int]) -> None:
        if self.enabled:
            self.lengths.prompts.append(prompt_tokens)
            self.lengths.outputs.append(sum(completion_tokens))
            self.lengths.completions += len(completion_tokens)

    def observe_status(self, replica: str, engine: Mapping[str, object]) -> None:
        if self.enabled:
            self.figures[replica] = {k: float(v) for k, v in engine.items() if isinstance(v, int | float)}

    def at_version(self, dep: DeploymentState) -> RatioDecision | None:
        """Decide (and apply) when every routable worker serves a version past the last boundary."""
        versions = [r.weight_version for r in dep.replicas if r.routable]
        if not self.enabled or not versions or min(versions) <= self.boundary:
            return None
        version = min(versions)
        self.boundary = version
        rates, mean_batch = measured_rates(self.figures, self._at_last, self.max_batch, self.rates)
        self._at_last = {k: dict(v) for k, v in self.figures.items()}
        if rates is None:  # nothing measured yet (the first version): nothing to decide from
            return None
        self.rates = rates
        current = Ratio(
            sum(r.role == ROLE_PREFILL for r in dep.replicas),
            sum(r.role == ROLE_DECODE for r in dep.replicas),
        )
        inputs = TuningInputs(
            deployment=dep.name,
            weight_version=version,
            workers=len(dep.replicas),
            current=current,
            lengths=self.lengths.stats(),
            rates=rates,
            in_flight=mean_batch * max(1, current.decode),
        )
        decision = tune(inputs, self.policy, self.last)
        self.last = decision
        if decision.reason not in _KEEP_LENGTHS:
            self.lengths = _Lengths()
        if decision.changed:
            apply_split(dep, decision.ratio)
        self._report(dep, decision)
        return decision

    def _report(self, dep: DeploymentState, decision: RatioDecision) -> None:
        dep.split_decision = f"{decision.ratio} at version {decision.inputs.weight_version}: {decision.reason}: {decision.detail}"
        log.info("split of %s: %s", dep.name, json.dumps(decision.as_log(), default=str))
        metrics.SPLIT_DECISIONS.labels(dep.name, decision.reason).inc()
        rates = decision.inputs.rates
        metrics.SPLIT_STAGE_SPEED.labels(dep.name, ROLE_PREFILL).set(rates.prefill_tokens_per_s)
        metrics.SPLIT_STAGE_SPEED.labels(dep.name, ROLE_DECODE).set(
            rates.decode_tokens_per_s(decision.inputs.in_flight / max(1, decision.ratio.decode))
        )
        export_roles(dep)


def apply_split(dep: DeploymentState, ratio: Ratio) -> None:
    """Give `ratio.prefill` workers the prefill stage and the rest decode, moving as few workers as
    possible and, of those, the ones with the fewest requests in flight."""
    prefill = [r for r in dep.replicas if r.role == ROLE_PREFILL]
    decode = [r for r in dep.replicas if r.role != ROLE_PREFILL]
    if len(prefill) < ratio.prefill:
        movers, role = (
            sorted(decode, key=lambda r: r.outstanding_requests)[: ratio.prefill - len(prefill)],
            ROLE_PREFILL,
        )
    else:
        movers, role = (
            sorted(prefill, key=lambda r: r.outstanding_requests)[: len(prefill) - ratio.prefill],
            ROLE_DECODE,
        )
    for replica in movers:
        replica.role = role


def export_roles(dep: DeploymentState) -> None:
    for role in (ROLE_PREFILL, ROLE_DECODE):
        metrics.SPLIT_WORKERS.labels(dep.name, role).set(sum(r.role == role for r in dep.replicas))
