"""Prefill/decode disaggregation with tuned ratios: the simulator at GPU scale, with a named GPU's
roofline (or a measured cost-model file), under length distributions that drift over a run.

Two deployments of one mixture-of-domains run, 8 workers (one GPU each, Qwen2.5-7B-shaped, bf16)
and synchronous RL steps, each with the lengths its profile drifts through:

- `code`: repository-context prompts (~8k tokens), 128 prompts x 4 samples a step (one shared
  prefill per group); outputs lengthen from ~300 to ~4,000 tokens as the policy learns to reason;
- `agent`: multi-turn agent turns, 512 a step; the context a turn prefills grows from ~2k to ~32k
  tokens as episodes lengthen, while each turn's output shrinks from ~800 to ~250.

Each is served three ways on the same requests: co-located workers (the CPU engine's continuous
batching, per worker), disaggregated with the P:D split the tuner (services/decisions/pd_ratio.py,
imported by sim/) picks for the first step's lengths and keeps (`fixed`), and disaggregated with the
tuner re-deciding at every weight-version boundary (`tuned`, hysteresis and bounded moves as in
production). Figure: sim_tuned_over_fixed_throughput, output tokens/s tuned over fixed, the lower
of the two profiles (target >= 1.2); beside it sim_tuned_over_colocated_throughput (the lower of
the two), which says whether disaggregation pays at all in this model (vLLM's own guidance: it buys
latency, not throughput). The profile's parameters are printed with each result.

    python -m bench.pd_disaggregation [--gpu H100|H200|A100|L40S] [--model SHAPE] [--cost-model FILE]
"""

from __future__ import annotations

import argparse
import time

from bench.common import emit, parse_args

BENCH = "pd_disaggregation"


def profiles(steps: int):
    from sim.workload import DriftingLengths, Lengths

    drift_to = max(4, steps // 2)
    return {
        "code": (DriftingLengths("code", Lengths(8000, 300), Lengths(8000, 4000), 3, drift_to), 128, 4),
        "agent": (DriftingLengths("agent", Lengths(2000, 800), Lengths(32000, 250), 3, drift_to), 512, 1),
    }


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default="H100", help="GPU whose roofline prices the steps (default H100)")
    parser.add_argument(
        "--model", default="qwen2.5-7b", help="model shape (services/decisions/cost_model.py)"
    )
    parser.add_argument("--cost-model", default="", help="a measured cost-model file instead of the roofline")
    parser.add_argument("--workers", type=int, default=8, help="workers (GPUs) per deployment")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    from services.decisions.cost_model import RooflineCost, cost_model
    from services.decisions.pd_ratio import TunerPolicy
    from sim.deployment import WorkerLimits, run_rl

    cost = cost_model(args.cost_model or f"roofline:{args.gpu}", args.model)
    kv = cost.kv_capacity_tokens() if isinstance(cost, RooflineCost) else 0
    limits = WorkerLimits(max_batch=256, max_prefill_tokens=16384, kv_tokens=kv)
    steps = 30  # cheap to simulate (seconds): --quick runs the same, so the figure means one thing
    print(
        f"costs: {cost.source}; {args.workers} workers per deployment, KV {kv:,} tokens per worker, {steps} steps"
    )
    tuned_over_fixed, tuned_over_colocated = {}, {}
    for name, (workload, groups, group_size) in profiles(steps).items():
        runs = {}
        for mode in ("colocated", "fixed", "tuned"):
            started = time.perf_counter()
            runs[mode] = run_rl(
                cost,
                workload,
                steps=steps,
                groups_per_step=groups,
                group_size=group_size,
                workers=args.workers,
                limits=limits,
                mode=mode,
                policy=TunerPolicy(),
                deployment=name,
            )
            run = runs[mode]
            p99 = max(s.p99_latency_s for s in run.steps)
            print(
                f"{name:<6} {mode:<10} {run.tokens_per_s:>10,.0f} tok/s  worst step p99 {p99:>7.1f} s  "
                f"({time.perf_counter() - started:.1f} s to simulate)"
            )
        moves = [
            f"v{s.decision.inputs.weight_version}: {s.decision.inputs.current} -> {s.decision.ratio}"
            for s in runs["tuned"].steps
            if s.decision is not None and s.decision.changed
        ]
        a, b = workload.start, workload.end
        print(
            f"       prompt {a.mean_prompt:.0f} -> {b.mean_prompt:.0f}, output {a.mean_output:.0f} -> "
            f"{b.mean_output:.0f} tokens over steps {workload.drift_from}-{workload.drift_to}, {groups} x "
            f"{group_size} a step; fixed at {runs['fixed'].ratios[0]}; tuned: {', '.join(moves) or 'no move'}"
        )
        tuned_over_fixed[name] = (runs["tuned"].tokens_per_s, runs["fixed"].tokens_per_s)
        tuned_over_colocated[name] = (runs["tuned"].tokens_per_s, runs["colocated"].tokens_per_s)
    for figure, pairs in (
        ("sim_tuned_over_fixed_throughput", tuned_over_fixed),
        ("sim_tuned_over_colocated_throughput", tuned_over_colocated),
    ):
        worst = min(pairs, key=lambda n: pairs[n][0] / pairs[n][1])
        value, baseline = pairs[worst]
        target = ">= 1.2" if figure == "sim_tuned_over_fixed_throughput" else "report"
        emit(BENCH, figure, value, baseline, value / baseline, f"tokens/s ({worst}, {cost.name})", target)


if __name__ == "__main__":
    main()
