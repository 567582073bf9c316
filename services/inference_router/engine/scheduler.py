"""Continuous batching: the asyncio scheduler shared by the CPU engine and the TP group.

One loop owns the running batch. Each iteration (a "step"):
  1. applies a pending weight swap (so a swap never lands inside a forward pass),
  2. admits waiting requests while KV-cache slots are free (FIFO; a request with n completions
     needs n slots) and prefills them in one batched forward,
  3. runs ONE batched decode forward for every running sequence,
  4. samples, appends, and retires sequences that hit a stop token or their max_tokens.
New requests therefore join the batch at the next step and finished ones leave at once.

LoRA: an executor that serves adapters (`serves_adapters`) holds several over one base; each
request names its own (`EngineRequest.adapter`), sequences of different adapters share every
batched forward, and each adapter has its own version: a token sampled with an adapter carries
that adapter's version, installed between two steps like the base's (`load_adapter`).

A weight swap between two steps leaves the running sequences' KV as it was (made under the old
version: `Completion.kv_versions` says so per token) unless `SchedulerLimits.kv_on_swap` is
"recompute": then, before their next decode step, every running sequence's prompt and tokens so
far are prefilled again under the new weights (what vLLM does after its prefix-cache reset), so no
token is ever sampled from KV of an older version. The scheduler counts what each stage did
(prompt tokens prefilled, decode steps, their batch and seconds, `stage_stats`), which status()
reports and a prefill/decode split is tuned from.

n > 1 is served with one slot per completion, every slot independent and exact; the model
computes the shared prompt once and copies its keys/values into the other slots.

Model compute runs on one dedicated worker thread (torch releases the GIL), so the event loop and
any gRPC server sharing it stay responsive during a step. The executor (what actually runs the
model: a local EngineModel, or rank 0 of a TP group) is behind the small `StepExecutor` protocol.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.inference_router.engine.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Engine,
    EngineRequest,
    EngineResult,
    EngineStatus,
    StreamChunk,
    validate_request,
)
from services.inference_router.engine.sampling import SamplerRow, make_generator, sample
from services.kit.rpc.errors import FailedPrecondition, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)


class StepExecutor(Protocol):
    """Runs the model for the scheduler. Called from ONE worker thread, never concurrently."""

    vocab_size: int
    max_model_len: int
    num_slots: int

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Fill the KV cache of `slots` with `prompts` (positions from 0); logits of each last token [S, V]."""
        ...

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Append one token per slot at `positions`; next-token logits [S, V]."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    @property
    def loaded(self) -> bool:
        """True once weights are installed (an engine without weights is not ready)."""
        ...

    def close(self) -> None: ...


@dataclass
class SchedulerLimits:
    max_waiting_requests: int = 1024
    # Prompt tokens prefilled in one step (at least one request is always admitted).
    max_prefill_tokens: int = 4096
    # Tokens that stop every request on top of its own stop_token_ids (e.g. the tokenizer's EOS).
    default_stop_token_ids: tuple[int, ...] = ()
    # What a weight swap does to running sequences' KV: "keep" it (decoded on under the new
    # weights), or "recompute" it under the new weights before their next step.
    kv_on_swap: str = "keep"


# Decode steps are counted by batch size in power-of-two buckets (1, 2, 4, ...).
def batch_bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class StageStats:
    """What the engine's forwards did since it started (busy time only)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    recompute_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # batch bucket -> [steps, tokens, seconds] of decode steps of that many sequences
    decode_by_batch: dict[int, list[float]] = field(default_factory=dict)

    def as_extra(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "recompute_tokens": self.recompute_tokens,
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
        }
        for bucket, (steps, tokens, seconds) in sorted(self.decode_by_batch.items()):
            out[f"decode_b{bucket}_steps"] = int(steps)
            out[f"decode_b{bucket}_tokens"] = int(tokens)
            out[f"decode_b{bucket}_seconds"] = seconds
        return out


@dataclass
class _Request:
    req: EngineRequest
    done: asyncio.Future
    stream: asyncio.Queue | None
    completions: list[Completion | None]
    remaining: int
    enqueued_at: float = field(default_factory=time.monotonic)

    def result(self) -> EngineResult:
        """The request's result, once every completion is in."""
        done = [c for c in self.completions if c is not None]
        assert len(done) == len(self.completions), "a completion is missing"
        return EngineResult(self.req.request_id, done, len(self.req.prompt_token_ids))


@dataclass
class _Seq:
    owner: _Request
    index: int
    slot: int
    prompt_len: int
    row: SamplerRow
    stop_ids: frozenset[int]
    max_tokens: int
    adapter: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    # Weight version of the oldest KV in its slot, and per token the one it was sampled from.
    kv_version: int = -1
    kv_versions: list[int] = field(default_factory=list)


class ContinuousBatchingEngine(Engine):
    """Engine over any StepExecutor; start() launches the scheduler loop on the running event loop."""

    def __init__(self, executor: StepExecutor, version: int = -1, limits: SchedulerLimits | None = None):
        self.executor = executor
        self.version = version
        self.limits = limits or SchedulerLimits()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Seq] = []
        # A heap, lowest slot first: a batch admitted together holds one ascending run of slots,
        # whose keys the executor can read without gathering them.
        self._free_slots = list(range(executor.num_slots))
        self._swaps: list[tuple[int, Callable[[], None], asyncio.Future, str]] = []
        self.adapter_versions: dict[str, int] = {}  # LoRA adapter served -> its version
        self._wake = asyncio.Event()
        self._paused = False
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        # Executor changes that must not race a step running in the worker thread (dropping an
        # adapter a dispatched batch still uses): applied as soon as no step is in flight.
        self._stepping = False
        self._after_step: list[Callable[[], None]] = []
        self.steps = 0
        self.generated_tokens = 0
        self.stage_stats = StageStats()
        self._kv_stale = False  # a swap left running sequences' KV to recompute (kv_on_swap)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> ContinuousBatchingEngine:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-scheduler")
        return self

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception:  # the loop already logged it
                pass
        self._abort_all("engine closed")
        self._pool.shutdown(wait=True)
        self.executor.close()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    # ---------------------------------------------------------------- requests
    def _enqueue(self, request: EngineRequest, stream: bool) -> _Request:
        if self._closed:
            raise Unavailable("engine is closed")
        if not self.executor.loaded:
            raise Unavailable("engine has no weights yet (waiting for the first weight version)")
        validate_request(
            request, vocab_size=self.executor.vocab_size, max_model_len=self.executor.max_model_len
        )
        if request.adapter and request.adapter not in self.adapter_versions:
            # Not the adapters it does serve: on a shared replica they are other tenants' runs.
            raise FailedPrecondition(f"adapter: {request.adapter!r} is not served here")
        if request.sampling.n > self.executor.num_slots:
            raise ResourceExhausted(
                f"sampling.n: {request.sampling.n} completions exceed this engine's {self.executor.num_slots} slots"
            )
        if len(self._waiting) >= self.limits.max_waiting_requests:
            raise ResourceExhausted(
                f"engine queue full ({len(self._waiting)} waiting requests)", retry_after_s=0.5
            )
        self.start()
        item = _Request(
            req=request,
            done=asyncio.get_running_loop().create_future(),
            stream=asyncio.Queue() if stream else None,
            completions=[None] * request.sampling.n,
            remaining=request.sampling.n,
        )
        self._waiting.append(item)
        self._wake.set()
        return item

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        items = [self._enqueue(r, stream=False) for r in requests]
        return list(await asyncio.gather(*(it.done for it in items)))

    async def generate_stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        item = self._enqueue(request, stream=True)
        assert item.stream is not None
        try:
            while True:
                chunk = await item.stream.get()
                if chunk is None:
                    break
                yield chunk
        finally:
            if not item.done.done():  # the consumer went away: stop generating for it
                self._abort_request(item)

    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        await self.swap(version, lambda: self.executor.load_weights(state_dict))

    async def rollback(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve the older `version` again (a canary that failed its check): like load_weights,
        between two decode steps and atomically, but allowed to go back. Sequences in flight
        continue on the restored weights; their tokens carry the version that sampled them."""
        await self.swap(version, lambda: self.executor.load_weights(state_dict), backwards=True)

    async def load_adapter(
        self, name: str, version: int, apply: Callable[[], None], *, backwards: bool = False
    ) -> None:
        """Serve LoRA adapter `name` at `version` from the next step on: `apply` installs it in the
        executor, between two steps, while requests of other adapters keep running."""
        if not getattr(self.executor, "serves_adapters", False):
            raise FailedPrecondition("adapter: this engine serves no LoRA adapters")
        if version < self.adapter_versions.get(name, -1) and not backwards:
            raise FailedPrecondition(
                f"version: {version} is older than adapter {name!r}'s serving version {self.adapter_versions[name]}"
            )
        await self.swap(version, apply, adapter=name)

    async def swap(
        self, version: int, apply: Callable[[], None], *, backwards: bool = False, adapter: str = ""
    ) -> None:
        """Run `apply` (which installs `version` in the executor) between two steps, then serve `version`.

        Runs even while paused (pause stops generation, not weight updates). If `apply` raises,
        the old weights keep serving (EngineModel.load_shard checks everything before changing anything).
        Only a rollback (`backwards`) may install a version older than the serving one."""
        if self._closed:
            raise Unavailable("engine is closed")
        if not adapter and version < self.version and not backwards:
            raise FailedPrecondition(f"version: {version} is older than the serving version {self.version}")
        self.start()
        fut = asyncio.get_running_loop().create_future()
        self._swaps.append((version, apply, fut, adapter))
        self._wake.set()
        await fut

    def status(self) -> EngineStatus:
        used = sum(s.prompt_len + len(s.tokens) for s in self._running)
        capacity = self.executor.num_slots * self.executor.max_model_len
        in_flight = sum(s.max_tokens - len(s.tokens) for s in self._running) + sum(
            w.req.sampling.max_tokens * w.req.sampling.n for w in self._waiting
        )
        return EngineStatus(
            weight_version=self.version,
            ready=not self._closed and self.executor.loaded,
            paused=self._paused,
            queued_requests=len(self._waiting),
            running_sequences=len(self._running),
            tokens_in_flight=in_flight,
            cache_usage=used / capacity if capacity else 0.0,
            max_model_len=self.executor.max_model_len,
            extra={
                "steps": self.steps,
                "generated_tokens": self.generated_tokens,
                "adapters": len(self.adapter_versions),
            }
            | self.stage_stats.as_extra(),
        )

    # ---------------------------------------------------------------- scheduler
    async def _loop(self) -> None:
        try:
            while not self._closed:
                if self._swaps:
                    await self._apply_swaps()
                    continue
                if self._paused or (not self._waiting and not self._running):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._stepping = True
                try:
                    await self._step()
                finally:
                    self._stepping = False
                    self._run_after_step()
                # Give queued callers (new requests, status, swaps) a turn between steps.
                await asyncio.sleep(0)
        except Exception as exc:
            log.exception("engine scheduler crashed")
            self._closed = True
            self._abort_all(f"engine failed: {exc}")
            for _, _, fut, _ in self._swaps:
                if not fut.done():
                    fut.set_exception(Unavailable(f"engine failed: {exc}"))
            raise

    async def _apply_swaps(self) -> None:
        swaps, self._swaps = self._swaps, []
        loop = asyncio.get_running_loop()
        for version, apply, fut, adapter in swaps:
            try:
                await loop.run_in_executor(self._pool, apply)
                if adapter:
                    self.adapter_versions[adapter] = version
                else:
                    self.version = version
                    self._kv_stale = self.limits.kv_on_swap == "recompute" and bool(self._running)
                fut.set_result(None)
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)

    async def _step(self) -> None:
        admitted = self._admit()
        if admitted:
            await self._prefill_admitted(admitted)
        if self._kv_stale:
            await self._recompute_kv()
        # Decode every running sequence that already has a token to feed (newly admitted ones too).
        batch = [s for s in self._running if not s.finish]
        if batch:
            start = time.perf_counter()
            logits = await asyncio.get_running_loop().run_in_executor(
                self._pool,
                self._call,
                self.executor.decode,
                batch,
                [s.slot for s in batch],
                [s.tokens[-1] for s in batch],
                [s.prompt_len + len(s.tokens) - 1 for s in batch],
            )
            self._count_decode(len(batch), time.perf_counter() - start)
            self._sample_and_append(batch, logits)
        self.steps += 1

    @staticmethod
    def _call(method: Callable[..., torch.Tensor], seqs: list[_Seq], *args: list) -> torch.Tensor:
        """`method(*args)`, with each sequence's adapter when any has one (only executors that serve
        adapters take them)."""
        if any(s.adapter for s in seqs):
            return method(*args, adapters=[s.adapter or None for s in seqs])
        return method(*args)

    async def _prefill_admitted(self, admitted: list[_Seq]) -> None:
        """Prefill the sequences admitted this step and sample their first tokens."""
        logits = await self._prefill(admitted, [s.owner.req.prompt_token_ids for s in admitted])
        self._sample_and_append(admitted, logits)

    async def _prefill(self, seqs: list[_Seq], token_lists: list[list[int]]) -> torch.Tensor:
        """One batched prefill of `token_lists` into the sequences' slots, counted, under the
        serving version (their KV's version from now on)."""
        start = time.perf_counter()
        logits = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._call, self.executor.prefill, seqs, [s.slot for s in seqs], token_lists
        )
        stats = self.stage_stats
        stats.prefill_seconds += time.perf_counter() - start
        stats.prefill_tokens += sum(len(t) for t in {id(t): t for t in token_lists}.values())
        for seq in seqs:
            seq.kv_version = self.version
        return logits

    async def _recompute_kv(self) -> None:
        """Prefill the prompt and tokens so far of every running sequence whose KV is older than the
        serving version (kv_on_swap = "recompute"); its last token is fed by the next decode step."""
        self._kv_stale = False
        stale = [s for s in self._running if not s.finish and s.kv_version != self.version]
        if not stale:
            return
        token_lists = [list(s.owner.req.prompt_token_ids) + s.tokens[:-1] for s in stale]
        await self._prefill(stale, token_lists)
        self.stage_stats.recompute_tokens += sum(len(t) for t in token_lists)

    def _count_decode(self, batch: int, seconds: float) -> None:
        stats = self.stage_stats
        stats.decode_steps += 1
        stats.decode_tokens += batch
        stats.decode_seconds += seconds
        bucket = stats.decode_by_batch.setdefault(batch_bucket(batch), [0, 0, 0.0])
        bucket[0] += 1
        bucket[1] += batch
        bucket[2] += seconds

    def _admit(self) -> list[_Seq]:
        admitted: list[_Seq] = []
        budget = self.limits.max_prefill_tokens
        while self._waiting:
            item = self._waiting[0]
            sp = item.req.sampling
            cost = len(item.req.prompt_token_ids) * sp.n
            if sp.n > len(self._free_slots) or (admitted and cost > budget):
                break
            self._waiting.popleft()
            budget -= cost
            stop_ids = frozenset(sp.stop_token_ids) | frozenset(self.limits.default_stop_token_ids)
            for i in range(sp.n):
                seed = None if sp.seed is None else sp.seed + i
                row = SamplerRow(
                    sp.temperature, sp.top_k, sp.top_p, None if sp.greedy else make_generator(seed)
                )
                seq = _Seq(
                    item,
                    i,
                    heapq.heappop(self._free_slots),
                    len(item.req.prompt_token_ids),
                    row,
                    stop_ids,
                    sp.max_tokens,
                    item.req.adapter,
                )
                admitted.append(seq)
                self._running.append(seq)
        return admitted

    def _sample_and_append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, [s.row for s in seqs])
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            if seq.finish:  # aborted while the step ran
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.adapter_versions[seq.adapter] if seq.adapter else self.version)
            seq.kv_versions.append(seq.kv_version)
            self.generated_tokens += 1
            if tok in seq.stop_ids:
                seq.finish = FINISH_STOP
            elif len(seq.tokens) >= seq.max_tokens:
                seq.finish = FINISH_LENGTH
            if seq.owner.stream is not None:
                seq.owner.stream.put_nowait(StreamChunk(seq.index, [tok], [lp], self.version, seq.finish))
            if seq.finish:
                self._retire(seq)
        self._running = [s for s in self._running if not s.finish]

    def _retire(self, seq: _Seq) -> None:
        heapq.heappush(self._free_slots, seq.slot)
        item = seq.owner
        item.completions[seq.index] = Completion(
            token_ids=seq.tokens,
            logprobs=seq.logprobs,
            finish_reason=seq.finish,
            weight_version=min(seq.versions, default=self.version),
            token_versions=seq.versions,
            kv_versions=seq.kv_versions,
        )
        item.remaining -= 1
        if item.remaining == 0 and not item.done.done():
            item.done.set_result(item.result())
            if item.stream is not None:
                item.stream.put_nowait(None)

    def _abort_request(self, item: _Request, reason: str = "") -> None:
        """Finish every completion of `item` still open with finish_reason "abort" (partial tokens kept)."""
        if item in self._waiting:
            self._waiting.remove(item)
        if reason:
            log.info("aborting request %s: %s", item.req.request_id, reason)
        for seq in self._running:
            if seq.owner is item and not seq.finish:
                seq.finish = FINISH_ABORT
                if item.stream is not None:
                    item.stream.put_nowait(StreamChunk(seq.index, [], [], self.version, FINISH_ABORT))
                self._retire(seq)
        self._running = [s for s in self._running if not s.finish]
        if item.done.done():
            return
        # Completions that never started (the request was still waiting) are reported empty.
        for i, c in enumerate(item.completions):
            if c is None:
                item.completions[i] = Completion([], [], FINISH_ABORT, self.version, [])
                if item.stream is not None:
                    item.stream.put_nowait(StreamChunk(i, [], [], self.version, FINISH_ABORT))
        item.done.set_result(item.result())
        if item.stream is not None:
            item.stream.put_nowait(None)

    def when_no_step_runs(self, apply: Callable[[], None]) -> None:
        """Run `apply` on the event loop while no step is in the executor: now when none is, else
        right after the one in flight returns."""
        if self._stepping:
            self._after_step.append(apply)
        else:
            apply()

    def _run_after_step(self) -> None:
        pending, self._after_step = self._after_step, []
        for apply in pending:
            apply()

    def abort_adapter(self, name: str) -> None:
        """End every request of adapter `name` (its run ended) as aborted; it is served no longer."""
        owners = {id(s.owner): s.owner for s in self._running if s.adapter == name}
        owners.update({id(w): w for w in self._waiting if w.req.adapter == name})
        for item in owners.values():
            self._abort_request(item, f"adapter {name!r} is no longer served")
        self.adapter_versions.pop(name, None)

    def _abort_all(self, reason: str) -> None:
        owners = {id(s.owner): s.owner for s in self._running}
        owners.update({id(w): w for w in self._waiting})
        for item in owners.values():
            self._abort_request(item, reason)
        self._waiting.clear()
