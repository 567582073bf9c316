"""Length-profile routing vs round-robin on a bimodal workload, over two deployments of the same
total resources (one tp=1 replica each, same batch limits).

Workload: open-loop Poisson arrivals of mostly short requests (few output tokens) mixed with long
ones, sized so both kinds carry about the same number of tokens. Round-robin spreads both kinds on
both replicas, so short requests queue behind long ones once the batch is full; length-profile
routing sends each kind to the deployment tuned for it. Same seed, same arrival times, same
replicas for both runs.

Figures: throughput_ratio (completed tokens/s, length-profile over round-robin) and p99_ratio
(p99 latency of SHORT requests, length-profile over round-robin; lower is better).
Targets: throughput_ratio >= 1.3 or p99_ratio <= 0.7.
"""

from __future__ import annotations

import asyncio
import random
import time

from bench.common import emit, parse_args, percentile

BENCH = "length_routing"


async def _run_mode(router, workload, max_tokens_of) -> tuple[list[float], float, int]:
    from looprl.common.v1 import common_pb2
    from looprl.inference.v1 import inference_pb2

    latencies_short: list[float] = []
    tokens = 0
    start = time.perf_counter()

    async def one(at: float, kind: str, prompt: list[int]) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens_of[kind], seed=7),
        )
        response = await router.generate(request)
        if kind == "short":
            latencies_short.append(time.perf_counter() - sent)
        tokens += sum(len(c.token_ids) for c in response.completions)

    await asyncio.gather(*(one(*w) for w in workload))
    return latencies_short, time.perf_counter() - start, tokens


def _router(states_and_handles, policy_name: str):
    from services.inference_router.policies import (
        DeploymentState,
        ReplicaState,
        RoundRobinDeployments,
        RoutingPolicy,
    )
    from services.inference_router.router import Router

    policy = RoutingPolicy(RoundRobinDeployments() if policy_name == "round_robin" else None)
    router = Router(policy)
    for dep, handles in states_and_handles:
        fresh = DeploymentState(name=dep.name, profile=dep.profile, max_model_len=dep.max_model_len)
        fresh.replicas = [
            ReplicaState(
                name=r.name,
                deployment=dep.name,
                healthy=True,
                weight_version=r.weight_version,
                max_outstanding_requests=10_000,
            )
            for r in dep.replicas
        ]
        router.add_deployment(fresh, handles)
    return router


async def main_async(quick: bool) -> None:
    import ray

    from bench.harness.local_fleet import load_weights, tiny_checkpoint
    from services.inference_router.config import RouterConfig
    from services.inference_router.deployments import DeploymentManager
    from services.inference_router.router import Router
    from services.kit.config.recipe import DeploymentSpec
    from services.kit.ray.cluster import connect_ray

    short_tokens, long_tokens = 4, 48
    n = 80 if quick else 240
    batch = 4
    connect_ray("", "bench-length-routing", num_cpus=4)
    cfg = RouterConfig()
    holder = Router()
    manager = DeploymentManager(holder, cfg)
    tables = [
        {"name": "short", "max_output_tokens": 16, "max_batch_size": batch, "max_model_len": 128},
        {"name": "long", "min_output_tokens": 17, "max_batch_size": batch, "max_model_len": 128},
    ]
    try:
        config, weights = tiny_checkpoint(seed=0)
        for t in tables:
            await manager.start(DeploymentSpec(**t))
        await asyncio.gather(*(load_weights(a, config, weights, 1) for a in manager.actors.values()))
        await holder.poll_once()
        pairs = [(d, [holder.handles[r.name] for r in d.replicas]) for d in holder.deployment_list()]

        # Calibrate: one long request alone gives the per-token time of this machine right now.
        probe = _router(pairs, "length_profile")
        await _run_mode(probe, [(0.0, "long", [1, 2, 3])] * 2, {"long": long_tokens})
        t0 = time.perf_counter()
        await _run_mode(probe, [(0.0, "long", [1, 2, 3])], {"long": long_tokens})
        per_token = (time.perf_counter() - t0) / long_tokens

        # Equal token mass per kind; offered load ~ 1.2 replicas' worth of unbatched decode.
        short_fraction = long_tokens / (long_tokens + short_tokens)
        mean_tokens = short_fraction * short_tokens + (1 - short_fraction) * long_tokens
        rate = 1.2 / (per_token * mean_tokens)
        rng = random.Random(0)
        at, workload = 0.0, []
        for _ in range(n):
            at += rng.expovariate(rate)
            kind = "short" if rng.random() < short_fraction else "long"
            prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(4, 12))]
            workload.append((at, kind, prompt))
        max_tokens_of = {"short": short_tokens, "long": long_tokens}
        results = {}
        for mode in ("round_robin", "length_profile"):
            results[mode] = await _run_mode(_router(pairs, mode), workload, max_tokens_of)
    finally:
        await manager.stop()
        ray.shutdown()

    rows = {}
    for mode, (lat, seconds, tokens) in results.items():
        rows[mode] = (tokens / seconds, percentile(lat, 50), percentile(lat, 99), len(lat))
    print(
        f"\n{n} requests, short={short_tokens} tok, long={long_tokens} tok, batch={batch}, "
        f"per-token {per_token * 1e3:.1f} ms, arrival rate {rate:.1f}/s"
    )
    print(f"{'routing':<16}{'tokens/s':>10}{'short p50 ms':>14}{'short p99 ms':>14}{'shorts':>8}")
    for mode, (tps, p50, p99, count) in rows.items():
        print(f"{mode:<16}{tps:>10.1f}{p50 * 1e3:>14.1f}{p99 * 1e3:>14.1f}{count:>8}")
    lp, rr = rows["length_profile"], rows["round_robin"]
    emit(BENCH, "throughput_ratio", lp[0], rr[0], lp[0] / rr[0], "tokens/s", ">= 1.3 (or p99_ratio <= 0.7)")
    emit(
        BENCH,
        "p99_ratio",
        lp[2] * 1e3,
        rr[2] * 1e3,
        lp[2] / rr[2],
        "ms",
        "<= 0.7 (or throughput_ratio >= 1.3)",
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    asyncio.run(main_async(args.quick))


if __name__ == "__main__":
    main()
