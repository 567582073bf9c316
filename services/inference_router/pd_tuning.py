"""The router's side of the P:D ratio tuner: what it observes per deployment, when it asks, and how
each decision is logged and exported.

The tuner (services/decisions/pd_ratio.py) is pure; this holds what it needs between decisions:

- `observe(deployment, prompt_tokens, output_tokens)` for every request the deployment served (the
  router calls it as a request finishes): the lengths since the last decision;
- `decide(deployment, version, workers, rates, in_flight)` when the deployment's workers all serve a
  new weight version (the boundary no request straddles): the decision for the next version,
  logged as one JSON line with every input and the reason, and exported as metrics
  (`looprl_router_pd_workers{deployment, stage}`, `looprl_router_pd_decisions_total{deployment,
  reason}`, `looprl_router_pd_predicted_requests_per_second{deployment, split}`).

A disaggregated deployment applies `RatioDecision.ratio` at that boundary (its prefill and decode
workers are weight-sync targets staged and committed together); the stage speeds come from its
workers' own measurements, or from a cost model (`rates_from_cost_model`) before they have any.
"""

from __future__ import annotations

import json
import logging
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
from services.kit.metric_names import counter, gauge

log = logging.getLogger("looprl.inference_router.pd_tuning")

WORKERS = gauge("looprl_router_pd_workers")
DECISIONS = counter("looprl_router_pd_decisions_total")
PREDICTED = gauge("looprl_router_pd_predicted_requests_per_second")


@dataclass
class _Window:
    """Lengths served since the last decision (sums: a window never grows with traffic)."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    completions: int = 0

    def stats(self) -> LengthStats:
        if not self.requests:
            return LengthStats(0, 0.0, 0.0)
        return LengthStats(
            self.requests,
            self.prompt_tokens / self.requests,
            self.output_tokens / self.requests,
            self.completions / self.requests,
        )


@dataclass
class RatioTuning:
    """Per-deployment windows and last decisions, for one router."""

    policy: TunerPolicy = field(default_factory=TunerPolicy)
    _windows: dict[str, _Window] = field(default_factory=dict)
    _last: dict[str, RatioDecision] = field(default_factory=dict)

    def observe(self, deployment: str, prompt_tokens: int, output_tokens: list[int]) -> None:
        """One served request: its prompt and each completion's length."""
        window = self._windows.setdefault(deployment, _Window())
        window.requests += 1
        window.prompt_tokens += prompt_tokens
        window.output_tokens += sum(output_tokens)
        window.completions += len(output_tokens)

    def current(self, deployment: str) -> Ratio | None:
        last = self._last.get(deployment)
        return last.ratio if last is not None else None

    def decide(
        self,
        deployment: str,
        version: int,
        workers: int,
        rates: StageRates,
        in_flight: float = 0.0,
        current: Ratio | None = None,
    ) -> RatioDecision:
        """The split for `version` on, from what was served since the last decision; logged and
        exported. `current`: the split in force when the deployment knows it better than we do."""
        last = self._last.get(deployment)
        window = self._windows.get(deployment, _Window())
        inputs = TuningInputs(
            deployment,
            version,
            workers,
            current or (last.ratio if last is not None else None),
            window.stats(),
            rates,
            in_flight,
        )
        decision = tune(inputs, self.policy, last)
        if decision.reason not in _KEEPS_EVIDENCE:  # the lengths were weighed: start a new window
            self._windows[deployment] = _Window()
        self._last[deployment] = decision
        self._export(decision)
        return decision

    def forget(self, deployment: str) -> None:
        """The deployment is gone (its run ended): its windows and series go too."""
        self._windows.pop(deployment, None)
        self._last.pop(deployment, None)
        for stage in ("prefill", "decode"):
            _remove(WORKERS, deployment, stage)
        for split in ("current", "chosen"):
            _remove(PREDICTED, deployment, split)

    @staticmethod
    def _export(decision: RatioDecision) -> None:
        name = decision.inputs.deployment
        WORKERS.labels(name, "prefill").set(decision.ratio.prefill)
        WORKERS.labels(name, "decode").set(decision.ratio.decode)
        DECISIONS.labels(name, decision.reason).inc()
        PREDICTED.labels(name, "current").set(decision.current_requests_per_s)
        PREDICTED.labels(name, "chosen").set(decision.chosen_requests_per_s)
        log.info("pd ratio decision %s", json.dumps(decision.as_log(), sort_keys=True))


# Decisions that did not weigh the lengths: they keep accumulating for the next version.
_KEEPS_EVIDENCE = frozenset({REASON_NOT_BOUNDARY, REASON_TOO_SOON, REASON_FEW_REQUESTS})


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
