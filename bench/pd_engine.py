"""The CPU engine's half of bench/pd_disaggregation.py: one deployment's workers on this machine,
serving an RL step's requests of one length profile three ways.

The workers are the disaggregated deployment's own engine (engine/disaggregated.py), one engine
thread each, in this process; the dispatch below is the router's two-phase request without the
gRPC hops (two_phase.py): a prefill worker prefills the prompt and leaves its KV in shared memory,
the decode worker reads it and decodes. Modes, on the same workers and the same seeded requests:

- `colocated`: every worker prefills and decodes its own requests (least busy worker first);
- `even`: the split at half and half (the hand-set 1:1 of the field's recipes);
- `tuned`: the split services/decisions/pd_ratio.py's `tune` picks from the speeds the workers
  measured while serving the profile at the even split (split_tuning.measured_rates, the router's
  own reading of the engines' stage counters) and the profile's lengths, as the router decides at
  the next weight-version boundary.

All requests of a step arrive at once (a synchronous RL step); throughput is output tokens over the
step's wall time, latency each request's time from the step's start to its last token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.common import percentile
from services.decisions.pd_ratio import LengthStats, Ratio, RatioDecision, TunerPolicy, TuningInputs, tune
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.disaggregated import DisaggregatedEngine, KVRequest
from services.inference_router.engine.kv_transfer import KVStore, decode, take_local
from services.inference_router.split_tuning import measured_rates
from services.modeling.config import ModelConfig
from services.modeling.qwen2 import Qwen2ForCausalLM

MAX_BATCH = 16
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Profile:
    name: str
    prompt_tokens: int
    output_tokens: int
    requests: int
    samples: int  # completions per request (a GRPO group shares one prefill)


PROFILES = (
    # Short prompts, long outputs (reasoning): decode is the work.
    Profile("reason", prompt_tokens=24, output_tokens=96, requests=12, samples=4),
    # Long prompts, short outputs (retrieval-style contexts, a verdict): prefill is the work.
    Profile("context", prompt_tokens=448, output_tokens=6, requests=48, samples=1),
)


@dataclass
class StepResult:
    mode: str
    ratio: str
    seconds: float
    output_tokens: int
    latencies: list[float]
    tokens: list[list[list[int]]]
    transfers: dict[str, int]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def p99_s(self) -> float:
        return percentile(self.latencies, 99)


def requests(profile: Profile, vocab: int, seed: int = 0) -> list[EngineRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [
        EngineRequest(
            torch.randint(1, vocab, (profile.prompt_tokens,), generator=gen).tolist(),
            # No stop tokens: every mode generates exactly the same number of tokens.
            SamplingParams(
                temperature=1.0, top_p=0.95, max_tokens=profile.output_tokens, n=profile.samples, seed=100 + i
            ),
            request_id=f"{profile.name}-{i}",
        )
        for i in range(profile.requests)
    ]


class Workers:
    """A deployment's workers and the router's least-busy, two-phase dispatch over them."""

    def __init__(self, engines: Sequence[DisaggregatedEngine]) -> None:
        self.engines = list(engines)
        self.busy = [0] * len(engines)

    @classmethod
    def create(cls, config: ModelConfig, state, count: int) -> Workers:
        return cls(
            [
                DisaggregatedEngine.create(
                    config,
                    state,
                    0,
                    kv_store=KVStore(),
                    max_batch_size=MAX_BATCH,
                    max_model_len=MAX_MODEL_LEN,
                )
                for _ in range(count)
            ]
        )

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    def stage_figures(self) -> dict[str, dict[str, float]]:
        return {
            f"w{i}": {k: float(v) for k, v in e.status().extra.items() if isinstance(v, int | float)}
            for i, e in enumerate(self.engines)
        }

    def _least_busy(self, among: range) -> int:
        return min(among, key=lambda i: self.busy[i])

    async def _on(self, worker: int, call):
        self.busy[worker] += 1
        try:
            return await call
        finally:
            self.busy[worker] -= 1

    async def serve(self, request: EngineRequest, ratio: Ratio | None) -> tuple[object, str]:
        """One request: on the least busy worker (co-located), or prefilled by the least busy of
        the first `ratio.prefill` workers and decoded by the least busy of the rest."""
        if ratio is None:
            worker = self._least_busy(range(len(self.engines)))
            (response,) = await self._on(worker, self.engines[worker].generate([request]))
            return response, "colocated"
        prefill = self._least_busy(range(ratio.prefill))
        store = self.engines[prefill].store
        handle = await self._on(prefill, self.engines[prefill].prefill_for_transfer(request))
        kv = await asyncio.to_thread(
            lambda: decode(take_local(handle.kv_id, store.directory), request.prompt_token_ids)
        )
        worker = self._least_busy(range(ratio.prefill, len(self.engines)))
        continued = KVRequest(
            request.prompt_token_ids, request.sampling, request_id=request.request_id, kv=kv
        )
        (response,) = await self._on(worker, self.engines[worker].generate([continued]))
        return response, continued.recomputed or "shm"

    async def step(self, mode: str, batch: list[EngineRequest], ratio: Ratio | None) -> StepResult:
        started = time.perf_counter()
        latencies: list[float] = [0.0] * len(batch)

        async def one(i: int, request: EngineRequest):
            out = await self.serve(request, ratio)
            latencies[i] = time.perf_counter() - started
            return out

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(batch)))
        seconds = time.perf_counter() - started
        tokens = [[list(c.token_ids) for c in response.completions] for response, _ in results]
        transfers: dict[str, int] = {}
        for _, how in results:
            transfers[how] = transfers.get(how, 0) + 1
        return StepResult(
            mode,
            str(ratio) if ratio else "co-located",
            seconds,
            sum(len(t) for group in tokens for t in group),
            latencies,
            tokens,
            transfers,
        )


def tuned_split(
    profile: Profile, workers: Workers, before: dict, current: Ratio, batch: list[EngineRequest]
) -> RatioDecision:
    """The tuner's decision at the boundary after the step served at `current`: the workers' stage
    speeds measured since `before`, and the step's lengths."""
    rates, _ = measured_rates(workers.stage_figures(), before, MAX_BATCH)
    assert rates is not None, "the step measured no prefill or no decode"
    lengths = LengthStats.of(
        [len(r.prompt_token_ids) for r in batch],
        [profile.output_tokens * profile.samples] * len(batch),
        profile.samples,
    )
    inputs = TuningInputs(
        deployment=profile.name,
        weight_version=1,
        workers=len(workers.engines),
        current=current,
        lengths=lengths,
        rates=rates,
        in_flight=float(len(batch) * profile.samples),
    )
    # One decision from the first measurement: any distance, as a deployment's first boundary may.
    policy = TunerPolicy(min_requests=1, max_move=len(workers.engines))
    return tune(inputs, policy, None)


def model_config() -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
    )


async def run_profile(profile: Profile, workers: Workers, vocab: int, rounds: int) -> dict[str, StepResult]:
    """The profile's step served co-located, at the even split, and at the tuned split: `rounds`
    times each, the modes interleaved in a rotating order, keeping each mode's fastest step (the
    other helpers' load on this shared machine comes and goes; interleaving spreads it over all).
    The step the tuner measures is not one of them."""
    count = len(workers.engines)
    even = Ratio(count // 2, count - count // 2)
    batch = requests(profile, vocab)
    before = workers.stage_figures()
    await workers.step("even", batch, even)  # what the tuner measures (as at a first version)
    runs: dict[str, StepResult] = {}
    decision = tuned_split(profile, workers, before, even, batch)
    print(f"  {profile.name}: tuner at {even}: {decision.ratio} ({decision.reason}: {decision.detail})")
    modes = [("colocated", None), ("tuned", decision.ratio), ("even", even)]
    for r in range(rounds):
        for mode, ratio in modes[r % 3 :] + modes[: r % 3]:
            run = await workers.step(mode, batch, ratio)
            if mode not in runs or run.seconds < runs[mode].seconds:
                runs[mode] = run
    return runs


async def measure(workers_count: int = 4, quick: bool = False) -> dict[str, dict[str, StepResult]]:
    torch.set_num_threads(1)  # one thread per worker: the workers share this machine's cores
    config = model_config()
    state = Qwen2ForCausalLM(config, seed=0).hf_state_dict()
    workers = Workers.create(config, state, workers_count)
    out = {}
    try:
        warm = [Profile("warm", 8, 4, 4, 2), Profile("warm-long", 448, 2, 2, 1)]
        for p in warm:  # every worker through both stages before anything is timed
            for ratio in (None, Ratio(workers_count // 2, workers_count - workers_count // 2)):
                await workers.step("warm-up", requests(p, config.vocab_size, seed=7), ratio)
        for profile in PROFILES:
            if quick:
                profile = Profile(
                    profile.name,
                    profile.prompt_tokens,
                    profile.output_tokens // 2,
                    profile.requests // 2,
                    profile.samples,
                )
            out[profile.name] = await run_profile(profile, workers, config.vocab_size, 2 if quick else 3)
    finally:
        await workers.close()
    return out
