"""One deployment, event by event: co-located workers, or prefill and decode workers (sim/workers.py)
with a KV hand-off between them; step costs from a `services.decisions.cost_model.CostModel`.

`run_rl` plays a run in synchronous steps (all of a step's requests released at once, the next step
when all are done: a weight-version boundary), with the split of workers fixed, or re-tuned at every
boundary by `services.decisions.pd_ratio.tune` (the tuner itself, imported).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.decisions.cost_model import CostModel
from services.decisions.pd_ratio import (
    REASON_INITIAL,
    LengthStats,
    Ratio,
    RatioDecision,
    TunerPolicy,
    TuningInputs,
    rates_from_cost_model,
    tune,
)
from sim.workers import Clock, Group, Request, Worker, WorkerLimits
from sim.workload import DriftingLengths

__all__ = ["Deployment", "PhaseResult", "Request", "RunResult", "StepRecord", "WorkerLimits", "run_rl"]


@dataclass
class PhaseResult:
    requests: list[Request]
    seconds: float
    workers: list[Worker]

    @property
    def output_tokens(self) -> int:
        return sum(r.output for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


class Deployment:
    """One deployment's workers: `colocated` of them, or a prefill:decode `ratio`."""

    def __init__(
        self,
        cost: CostModel,
        limits: WorkerLimits,
        *,
        colocated: int = 0,
        ratio: Ratio | None = None,
        prefill_limits: WorkerLimits | None = None,
    ) -> None:
        if (colocated > 0) == (ratio is not None):
            raise ValueError("give either colocated workers or a prefill:decode ratio")
        if ratio is not None and (ratio.prefill < 1 or ratio.decode < 1):
            raise ValueError(f"ratio {ratio}: at least one worker of each stage")
        self.cost, self.limits, self.clock = cost, limits, Clock()
        if ratio is None:
            self.front = [Worker(self, "colocated", i) for i in range(colocated)]
            self.decoders: list[Worker] = []
        else:
            self.front = [Worker(self, "prefill", i) for i in range(ratio.prefill)]
            self.decoders = [Worker(self, "decode", i) for i in range(ratio.decode)]
            if prefill_limits is not None:
                for w in self.front:
                    w.limits = prefill_limits

    def serve(self, arrivals: Sequence[tuple[float, int, Sequence[int]]]) -> PhaseResult:
        """Serve groups (arrival time, prompt tokens, each sample's output tokens); returns when all
        are done."""
        ids = itertools.count()
        groups = [[Request(next(ids), max(1, p), max(1, o), t) for o in outs] for t, p, outs in arrivals]
        for g in groups:
            self.clock.at(g[0].arrival, lambda g=g: self._route(g))
        requests = [r for g in groups for r in g]
        start = min((r.arrival for r in requests), default=0.0)
        self.clock.run()
        end = max((r.done_at for r in requests), default=start)
        return PhaseResult(requests, end - start, [*self.front, *self.decoders])

    def _route(self, group: Group) -> None:
        if self.decoders:  # prefill: fewest prompt tokens queued
            worker = min(self.front, key=lambda w: (w.queued_prompt_tokens, w.name))
        else:
            worker = min(self.front, key=lambda w: (w.load, w.name))
        worker.offer(group)

    def hand_off(self, group: Group) -> None:
        """A prefilled group's KV moves to the decode worker with the fewest sequences."""
        worker = min(self.decoders, key=lambda w: (w.load, w.name))
        worker.in_transit += len(group)

        def arrive() -> None:
            worker.in_transit -= len(group)
            worker.offer(group)

        self.clock.at(self.clock.now + self.cost.kv_transfer_seconds(group[0].prompt), arrive)


@dataclass(frozen=True)
class StepRecord:
    step: int
    ratio: Ratio | None
    seconds: float
    output_tokens: int
    prompt_tokens: int
    p99_latency_s: float
    decision: RatioDecision | None = None


@dataclass
class RunResult:
    mode: str
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def ratios(self) -> list[str]:
        return [str(s.ratio) if s.ratio else "colocated" for s in self.steps]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def run_rl(
    cost: CostModel,
    workload: DriftingLengths,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    workers: int,
    limits: WorkerLimits,
    mode: Literal["colocated", "fixed", "tuned"],
    policy: TunerPolicy | None = None,
    seed: int = 0,
    prefill_limits: WorkerLimits | None = None,
    deployment: str = "sim",
    start: Ratio | None = None,
) -> RunResult:
    """A run of synchronous steps (each releases its groups at once; the next starts when all are
    done). `fixed` keeps the split the tuner picks for the first step's lengths (or `start`, a split
    set by hand); `tuned` starts there and lets the tuner re-decide at every weight-version boundary (after each step) from the lengths the
    deployment served and the cost model's stage speeds at them, as a service would from its
    measurements. A group is one request of `group_size` completions (one prefill)."""
    policy = policy or TunerPolicy()
    prefill_tokens = (prefill_limits or limits).max_prefill_tokens

    def inputs(version: int, current: Ratio | None, batch: list[tuple[int, list[int]]]) -> TuningInputs:
        lengths = LengthStats.of([p for p, _ in batch], [sum(outs) for _, outs in batch], group_size)
        rates = rates_from_cost_model(cost, lengths, limits.max_batch, limits.kv_tokens, prefill_tokens)
        in_flight = float(groups_per_step * group_size)
        return TuningInputs(deployment, version, workers, current, lengths, rates, in_flight)

    result = RunResult(mode)
    ratio: Ratio | None = None
    last: RatioDecision | None = None
    if mode != "colocated" and start is not None:
        if start.workers != workers or start.prefill < 1 or start.decode < 1:
            raise ValueError(f"start {start}: {workers} workers, at least one of each stage")
        ratio = start
    elif mode != "colocated":
        last = tune(inputs(0, None, workload.groups(0, groups_per_step, group_size, seed)), policy)
        if last.reason != REASON_INITIAL:
            raise ValueError(f"workers: {last.detail}")
        ratio = last.ratio
    for step in range(steps):
        batch = workload.groups(step, groups_per_step, group_size, seed)
        if ratio is None:
            dep = Deployment(cost, limits, colocated=workers)
        else:
            dep = Deployment(cost, limits, ratio=ratio, prefill_limits=prefill_limits)
        phase = dep.serve([(0.0, p, outs) for p, outs in batch])
        decision = None
        if mode == "tuned":
            decision = last = tune(inputs(step + 1, ratio, batch), policy, last)
        result.steps.append(
            StepRecord(
                step,
                ratio,
                phase.seconds,
                phase.output_tokens,
                sum(p for p, _ in batch),
                percentile([r.latency for r in phase.requests], 99),
                decision,
            )
        )
        if decision is not None:
            ratio = decision.ratio
    return result
