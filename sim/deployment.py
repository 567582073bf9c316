"""One deployment, event by event: co-located workers or prefill and decode workers.

Workers follow the engines they model:

- a **co-located** worker is the CPU engine's continuous batching (services/inference_router/engine/
  scheduler.py): each step admits waiting requests FIFO while slots are free (and the prefill token
  budget lasts; one request is always admitted), prefills them in one batched forward (their first
  token is sampled there), then runs one decode step for every running sequence;
- a **prefill** worker prefills batches of waiting prompts (up to `max_prefill_tokens`), samples
  their first token and hands each request's KV to the least loaded decode worker (the transfer
  takes `kv_transfer_seconds`);
- a **decode** worker admits arrived sequences while it has slots and KV room and decodes its batch.

Step costs come from a `services.decisions.cost_model.CostModel`. Decoding runs in chunks: while a
worker's batch cannot change (no sequence finishes and nothing can be admitted) k steps cost
k x step(batch, mid-chunk context), exact for costs linear in the context; a request that arrives
at a worker with room cuts the chunk at the first step boundary after it, as the engine would
admit it at its next step. So a simulated run costs events per batch change, not per token.

`run_rl` plays a run in synchronous steps (all of a step's requests released at once, the next step
when all are done: a weight-version boundary), with the split of workers fixed, or re-tuned at every
boundary by `services.decisions.pd_ratio.tune` (the tuner itself, imported).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
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
from sim.workload import DriftingLengths

Role = Literal["colocated", "prefill", "decode"]


@dataclass(eq=False)
class Request:
    """One sequence. Samples of a group share their prompt: one prefill, one KV hand-off."""

    id: int
    prompt: int
    output: int
    arrival: float
    generated: int = 0
    first_token_at: float = math.nan
    done_at: float = math.nan

    @property
    def remaining(self) -> int:
        return self.output - self.generated

    @property
    def latency(self) -> float:
        return self.done_at - self.arrival


Group = list[Request]


class Clock:
    """The event queue: callbacks at times, cancellable."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[list] = []
        self._order = itertools.count()

    def at(self, time: float, callback: Callable[[], None]) -> list:
        entry = [time, next(self._order), callback, True]
        heapq.heappush(self._heap, entry)
        return entry

    @staticmethod
    def cancel(entry: list) -> None:
        entry[3] = False

    def run(self) -> None:
        while self._heap:
            time, _, callback, alive = heapq.heappop(self._heap)
            if alive:
                self.now = time
                callback()


@dataclass(frozen=True)
class WorkerLimits:
    """What one worker holds: slots, prompt tokens per prefill batch, KV capacity (0: slots only)."""

    max_batch: int = 256
    max_prefill_tokens: int = 8192
    kv_tokens: int = 0


@dataclass
class _Chunk:
    """Work in flight on a worker: a prefill of `prefill_s`, then `steps` decode steps of `batch`."""

    start: float
    prefill_s: float
    batch: list[Request]
    context: int
    steps: int
    event: list
    groups: list[Group] = field(default_factory=list)  # a prefill worker's admitted groups


@dataclass
class WorkerStats:
    busy_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0


class Worker:
    def __init__(self, deployment: Deployment, role: Role, index: int) -> None:
        self.deployment, self.role, self.name = deployment, role, f"{role}-{index}"
        self.cost, self.limits, self.clock = deployment.cost, deployment.limits, deployment.clock
        self.waiting: deque[Group] = deque()
        self.running: list[Request] = []
        self.kv_reserved = 0
        self.in_transit = 0
        self.chunk: _Chunk | None = None
        self._kicked = False
        self.stats = WorkerStats()

    @property
    def load(self) -> int:
        """Sequences waiting, running and on their way here."""
        return sum(len(g) for g in self.waiting) + len(self.running) + self.in_transit

    @property
    def queued_prompt_tokens(self) -> int:
        busy = sum(r.prompt for r in self.chunk.batch) if self.chunk else 0
        return sum(g[0].prompt for g in self.waiting) + busy

    def _has_room(self, group: Group) -> bool:
        if len(self.running) + len(group) > self.limits.max_batch:
            return False
        kv = self.limits.kv_tokens
        need = sum(r.prompt + r.output for r in group)
        return not kv or not self.running or self.kv_reserved + need <= kv

    def offer(self, group: Group) -> None:
        self.waiting.append(group)
        if self.chunk is None:
            if not self._kicked:  # after every arrival of this instant: they are admitted together
                self._kicked = True
                self.clock.at(self.clock.now, self._kick)
        elif self.role != "prefill" and self._has_room(group):
            self._cut_chunk()

    def _kick(self) -> None:
        self._kicked = False
        if self.chunk is None:
            self._step()

    # -- a step -------------------------------------------------------------------------------

    def _admit(self) -> list[Group]:
        """Groups admitted FIFO: a decoding worker needs slots (and KV room) for all of a group's
        samples; a prefilling one stops at its prompt-token budget (the engine counts a group's
        prompt once per sample against it), admitting at least one group."""
        admitted: list[Group] = []
        budget = self.limits.max_prefill_tokens
        while self.waiting:
            head = self.waiting[0]
            cost = head[0].prompt * len(head)
            if self.role != "prefill" and not self._has_room(head):
                break
            if self.role != "decode" and admitted and cost > budget:
                break
            self.waiting.popleft()
            budget -= cost
            admitted.append(head)
            if self.role != "prefill":
                self.running.extend(head)
                self.kv_reserved += sum(r.prompt + r.output for r in head)
        return admitted

    def _step(self) -> None:
        now = self.clock.now
        admitted = self._admit()
        prefill_s = 0.0
        if admitted and self.role != "decode":
            prompts = [g[0].prompt for g in admitted]  # a group's shared prompt is computed once
            prefill_s = self.cost.prefill_seconds(prompts)
            self.stats.prefill_seconds += prefill_s
            self.stats.prefill_tokens += sum(prompts)
            for r in itertools.chain.from_iterable(admitted):  # first tokens come from the prefill
                r.generated = 1
                r.first_token_at = now + prefill_s
        if self.role == "prefill":
            if admitted:
                event = self.clock.at(now + prefill_s, self._prefilled)
                self.chunk = _Chunk(now, prefill_s, [r for g in admitted for r in g], 0, 0, event, admitted)
            return
        for r in [r for g in admitted for r in g if r.remaining <= 0]:
            self._finish(r, now + prefill_s)
        batch = list(self.running)
        if not batch:
            if prefill_s:  # everything admitted finished at its first token
                self.chunk = _Chunk(now, prefill_s, [], 0, 0, self.clock.at(now + prefill_s, self._decoded))
            return
        steps = min(r.remaining for r in batch)
        if self.waiting and self._has_room(self.waiting[0]):
            steps = 1  # admit the next group at the next step
        context = sum(r.prompt + r.generated for r in batch)
        end = now + prefill_s + self._decode_seconds(len(batch), context, steps)
        self.chunk = _Chunk(now, prefill_s, batch, context, steps, self.clock.at(end, self._decoded))

    def _decode_seconds(self, batch: int, context: int, steps: int) -> float:
        return steps * self.cost.decode_step_seconds(batch, context + batch * (steps - 1) / 2)

    def _cut_chunk(self) -> None:
        """End the running chunk at the first step boundary after now (a group can join)."""
        chunk = self.chunk
        assert chunk is not None
        if chunk.steps <= 1:
            return
        elapsed = self.clock.now - chunk.start - chunk.prefill_s
        n = len(chunk.batch)
        lo, hi = 1, chunk.steps
        while lo < hi:  # the fewest steps that reach now
            mid = (lo + hi) // 2
            if self._decode_seconds(n, chunk.context, mid) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        if lo < chunk.steps:
            Clock.cancel(chunk.event)
            chunk.steps = lo
            end = chunk.start + chunk.prefill_s + self._decode_seconds(n, chunk.context, lo)
            chunk.event = self.clock.at(end, self._decoded)

    def _decoded(self) -> None:
        chunk, self.chunk = self.chunk, None
        assert chunk is not None
        now = self.clock.now
        self.stats.busy_seconds += now - chunk.start
        self.stats.decode_seconds += now - chunk.start - chunk.prefill_s
        self.stats.decode_steps += chunk.steps
        self.stats.decode_tokens += chunk.steps * len(chunk.batch)
        for r in chunk.batch:
            r.generated += chunk.steps
            if r.remaining <= 0:
                self._finish(r, now)
        self._step()

    def _finish(self, request: Request, at: float) -> None:
        request.done_at = at
        self.running.remove(request)
        self.kv_reserved -= request.prompt + request.output

    def _prefilled(self) -> None:
        chunk, self.chunk = self.chunk, None
        assert chunk is not None
        self.stats.busy_seconds += chunk.prefill_s
        for group in chunk.groups:
            for r in group:
                if r.remaining <= 0:
                    r.done_at = self.clock.now
            going_on = [r for r in group if r.remaining > 0]
            if going_on:
                self.deployment.hand_off(going_on)
        self._step()


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
) -> RunResult:
    """A run of synchronous steps (each releases its groups at once; the next starts when all are
    done). `fixed` keeps the split the tuner picks for the first step's lengths; `tuned` lets the
    tuner re-decide at every weight-version boundary (after each step) from the lengths the
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
    if mode != "colocated":
        start = inputs(0, None, workload.groups(0, groups_per_step, group_size, seed))
        last = tune(start, policy)
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
