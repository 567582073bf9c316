"""The deployment simulator against the engine it models, on this machine.

The CPU engine (services/inference_router/engine, the tiny Qwen2 preset, 16 slots) is measured into
a cost-model file (sim/engine_costs.py: prefill and decode points at batch 1-16, prompts 16-256),
then serves a small mixed workload for real: requests and GRPO-style groups (one request of n
completions) with prompts of 8-160 tokens and 4-64 output tokens, a burst at the start, then Poisson
arrivals faster than the engine serves them (so the throughput measured is the engine's own). The simulator's co-located worker (sim/deployment.py)
serves the same arrivals with the measured costs. Each side runs `repeat` times; medians compare.

Figures: sim_over_engine_throughput (completion tokens/s, simulated over measured) and
sim_over_engine_mean_latency (mean request latency, simulated over measured); target: within 25%
(0.75-1.25). The engine's own numbers (tokens/s, latency) print beside them.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from bench.common import emit, parse_args

BENCH = "sim_fidelity"
SLOTS = 16


def workload(seed: int, count: int, rate: float) -> list[tuple[float, int, list[int]]]:
    """(arrival s, prompt tokens, each completion's tokens): a burst of 8, then Poisson arrivals."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(count):
        if i >= 8:
            at += rng.expovariate(rate)
        n = 4 if rng.random() < 0.25 else 1
        out.append((at, rng.randrange(8, 160), [rng.randrange(4, 64)] * n))
    return out


async def serve_on_engine(make_engine, arrivals, vocab: int) -> tuple[float, list[float], int]:
    """Serve the arrivals on a fresh engine; (seconds, latency per request, completion tokens)."""
    from services.inference_router.engine.base import EngineRequest, SamplingParams

    engine = make_engine(SLOTS, 256, 4096)
    latencies: list[float] = []
    tokens = 0
    start = time.perf_counter()

    async def one(i: int, at: float, prompt: int, outputs: list[int]) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        request = EngineRequest(
            [(i * 13 + j * 7) % (vocab - 1) + 1 for j in range(prompt)],
            SamplingParams(temperature=1.0, max_tokens=outputs[0], n=len(outputs), seed=i + 1),
        )
        (result,) = await engine.generate([request])
        latencies.append(time.perf_counter() - sent)
        tokens += sum(len(c.token_ids) for c in result.completions)

    try:
        await one(-1, 0.0, 32, [8])  # warm-up, outside the measurement
        latencies.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(i, *a) for i, a in enumerate(arrivals)))
        seconds = time.perf_counter() - start
    finally:
        await engine.close()
    return seconds, latencies, tokens


def serve_in_sim(cost, arrivals) -> tuple[float, list[float], int]:
    from sim.deployment import Deployment, WorkerLimits

    phase = Deployment(cost, WorkerLimits(max_batch=SLOTS, max_prefill_tokens=4096), colocated=1).serve(
        arrivals
    )
    latencies = []
    index = 0
    for _, _, outs in arrivals:  # a group's latency: until its last completion, as the engine answers
        group = phase.requests[index : index + len(outs)]
        index += len(outs)
        latencies.append(max(r.done_at for r in group) - group[0].arrival)
    end = max(r.done_at for r in phase.requests)
    return end - min(a for a, _, _ in arrivals), latencies, phase.output_tokens


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import torch

    from services.decisions.cost_model import MeasuredCost
    from services.modeling.config import ModelConfig
    from sim.engine_costs import cpu_engine_factory, measure_engine

    torch.manual_seed(0)
    config = ModelConfig.tiny()
    make_engine = cpu_engine_factory(config)
    repeat = 2 if args.quick else 3
    count = 24 if args.quick else 48
    data = asyncio.run(
        measure_engine(
            make_engine,
            config.vocab_size,
            batches=(1, 4, 8, 16),
            prompt_lengths=(16, 64, 160),
            decode_steps=24,
            repeat=repeat,
            log=print,
        )
    )
    data.update(device="cpu (this machine)", device_kind="cpu", dtype="float32", model=config.to_dict())
    cost = MeasuredCost.from_data(data)
    print(f"fitted prefill {cost.prefill_coef}, decode {cost.decode_coef}")
    # Arrivals at about the capacity the measurement implies for this mix.
    mean_tokens = 1.75 * 34
    step = cost.decode_step_seconds(8, 8 * 120)
    rate = 1.5 * 8 / (step * mean_tokens)
    arrivals = workload(1, count, rate)
    engine_runs = [
        asyncio.run(serve_on_engine(make_engine, arrivals, config.vocab_size)) for _ in range(repeat)
    ]
    sim = serve_in_sim(cost, arrivals)
    engine_seconds = statistics.median(r[0] for r in engine_runs)
    engine_latency = statistics.median(statistics.mean(r[1]) for r in engine_runs)
    tokens = engine_runs[0][2]
    assert tokens == sim[2], f"the engine served {tokens} tokens, the simulator {sim[2]}"
    sim_tps, engine_tps = tokens / sim[0], tokens / engine_seconds
    sim_latency = statistics.mean(sim[1])
    print(
        f"\n{count} requests ({tokens} completion tokens), arrival rate {rate:.1f}/s\n"
        f"{'':<10}{'tokens/s':>10}{'mean latency ms':>18}\n"
        f"{'engine':<10}{engine_tps:>10.0f}{engine_latency * 1e3:>18.1f}\n"
        f"{'simulator':<10}{sim_tps:>10.0f}{sim_latency * 1e3:>18.1f}"
    )
    emit(
        BENCH,
        "sim_over_engine_throughput",
        sim_tps,
        engine_tps,
        sim_tps / engine_tps,
        "tokens/s",
        "0.75..1.25",
    )
    emit(
        BENCH,
        "sim_over_engine_mean_latency",
        sim_latency * 1e3,
        engine_latency * 1e3,
        sim_latency / engine_latency,
        "ms",
        "0.75..1.25",
    )


if __name__ == "__main__":
    main()
