"""The workers of a simulated deployment, and the clock they run on.

- a **co-located** worker is the CPU engine's continuous batching (services/inference_router/engine/
  scheduler.py): each step admits waiting groups FIFO while slots are free (and the prefill token
  budget lasts; one group is always admitted), prefills them in one batched forward (their first
  token is sampled there), then runs one decode step for every running sequence;
- a **prefill** worker prefills batches of waiting prompts (up to `max_prefill_tokens`), samples
  their first token and hands each group's KV to its host (`Host.hand_off`);
- a **decode** worker admits arrived sequences while it has slots and KV room and decodes its batch.

Decoding runs in chunks: while a worker's batch cannot change (no sequence finishes and nothing can
be admitted) k steps cost k x step(batch, mid-chunk context), exact for costs linear in the context;
a group that arrives at a worker with room cuts the chunk at the first step boundary after it, as
the engine would admit it at its next step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from services.decisions.cost_model import CostModel

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


class Host(Protocol):
    """What a worker needs of its deployment."""

    cost: CostModel
    limits: WorkerLimits
    clock: Clock

    def hand_off(self, group: Group) -> None: ...


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
    def __init__(self, deployment: Host, role: Role, index: int) -> None:
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
