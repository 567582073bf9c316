"""Prefill/decode disaggregation with tuned ratios: the simulator at GPU scale, with a named GPU's
roofline (or a measured cost-model file), under length distributions that drift over a run.

Two deployments of one mixture-of-domains run, 8 workers (one GPU each, Qwen2.5-7B-shaped, bf16)
and synchronous RL steps, each with the lengths its profile drifts through:

- `code`: repository-context prompts (~8k tokens), 128 prompts x 4 samples a step (one shared
  prefill per group); outputs lengthen from ~300 to ~4,000 tokens as the policy learns to reason;
- `agent`: multi-turn agent turns, 512 a step; the context a turn prefills grows from ~2k to ~32k
  tokens as episodes lengthen, while each turn's output shrinks from ~800 to ~250.

Each is served four ways on the same requests: co-located workers (the CPU engine's continuous
batching, per worker), disaggregated at a fixed 1:1 split (`even`, the hand-set default of the
field's recipes), disaggregated with the P:D split the tuner (services/decisions/pd_ratio.py,
imported by sim/) picks for the first step's lengths and keeps (`fixed`), and disaggregated with the
tuner re-deciding at every weight-version boundary (`tuned`, hysteresis and bounded moves as in
production). Figure: sim_tuned_over_fixed_throughput, output tokens/s tuned over fixed, the lower
of the two profiles (target >= 1.2); beside it, each the less favourable of the two profiles,
sim_tuned_over_even_throughput, sim_tuned_over_colocated_throughput (whether disaggregation pays
at all in this model; vLLM's own guidance: it buys latency, not throughput) and
sim_tuned_over_fixed_p99_latency (the worst step's p99 request latency, tuned over fixed; a
synchronous step's p99 is close to its length). The profile's parameters are printed with each
result.

Then the same comparison on this machine with the CPU engine's own disaggregated workers
(bench/pd_engine.py: 4 workers, one engine thread each, KV handed over in shared memory): a
short-prompt/long-output profile and a long-prompt/short-output one, each served co-located, at the
fixed 2:2 split and at the split the tuner picks from the speeds the workers measured at 2:2
(each mode's fastest of 3 steps, the modes interleaved).
Figures cpu_tuned_over_even_throughput, cpu_tuned_over_colocated_throughput and
cpu_tuned_over_even_p99_latency, each the less favourable profile. The 4 workers share this
machine's 2 cores: a worker idle at its stage gives its core to the busy ones, which hides much of
the imbalance a tuned split removes on dedicated hardware; the figures say what 2 cores allow.

    python -m bench.pd_disaggregation [--gpu H100|H200|A100|L40S] [--model SHAPE] [--cost-model FILE]
        [--no-engine]
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
    parser.add_argument("--no-engine", action="store_true", help="the simulator only, not the CPU engine")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    from services.decisions.cost_model import RooflineCost, cost_model
    from services.decisions.pd_ratio import Ratio, TunerPolicy
    from sim.deployment import WorkerLimits, run_rl

    cost = cost_model(args.cost_model or f"roofline:{args.gpu}", args.model)
    kv = cost.kv_capacity_tokens() if isinstance(cost, RooflineCost) else 0
    limits = WorkerLimits(max_batch=256, max_prefill_tokens=16384, kv_tokens=kv)
    steps = 30  # cheap to simulate (seconds): --quick runs the same, so the figure means one thing
    print(
        f"costs: {cost.source}; {args.workers} workers per deployment, KV {kv:,} tokens per worker, {steps} steps"
    )
    even = Ratio(args.workers // 2, args.workers - args.workers // 2)
    pairs: dict[str, dict[str, tuple[float, float]]] = {}
    for name, (workload, groups, group_size) in profiles(steps).items():
        runs, p99 = {}, {}
        for label, mode in (
            ("colocated", "colocated"),
            ("even", "fixed"),
            ("fixed", "fixed"),
            ("tuned", "tuned"),
        ):
            started = time.perf_counter()
            runs[label] = run_rl(
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
                start=even if label == "even" else None,
            )
            run = runs[label]
            p99[label] = max(s.p99_latency_s for s in run.steps)
            print(
                f"{name:<6} {label:<10} {run.tokens_per_s:>10,.0f} tok/s  worst step p99 {p99[label]:>7.1f} s  "
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
        tuned = runs["tuned"].tokens_per_s
        for other in ("fixed", "even", "colocated"):
            pairs.setdefault(f"sim_tuned_over_{other}_throughput", {})[name] = (
                tuned,
                runs[other].tokens_per_s,
            )
        pairs.setdefault("sim_tuned_over_fixed_p99_latency", {})[name] = (p99["tuned"], p99["fixed"])
    _emit_worst(pairs, cost.name)
    if not args.no_engine:
        _emit_worst(cpu_engine(args.quick), "CPU engine, 4 workers on this machine")


def _emit_worst(pairs: dict[str, dict[str, tuple[float, float]]], where: str) -> None:
    for figure, by_profile in pairs.items():
        latency = figure.endswith("latency")
        # The less favourable profile: the lower throughput ratio, the higher latency ratio.
        pick = max if latency else min
        worst = pick(by_profile, key=lambda n: by_profile[n][0] / by_profile[n][1])
        value, baseline = by_profile[worst]
        target = ">= 1.2" if figure == "sim_tuned_over_fixed_throughput" else "report"
        unit = "s, worst step p99" if latency else "tokens/s"
        emit(BENCH, figure, value, baseline, value / baseline, f"{unit} ({worst}, {where})", target)


def cpu_engine(quick: bool) -> dict[str, dict[str, tuple[float, float]]]:
    """The CPU engine's workers serving each profile three ways (bench/pd_engine.py)."""
    import asyncio

    from bench.pd_engine import measure

    print("\nCPU engine, 4 disaggregated workers on this machine, one step of each profile:")
    pairs: dict[str, dict[str, tuple[float, float]]] = {}
    for name, runs in asyncio.run(measure(quick=quick)).items():
        for label, run in runs.items():
            print(
                f"{name:<8} {label:<10} {run.ratio:<11} {run.tokens_per_s:>8,.0f} tok/s  p99 {run.p99_s:>6.2f} s  "
                f"handoffs {run.transfers}"
            )
        same = sum(a == b for a, b in zip(runs["colocated"].tokens, runs["tuned"].tokens, strict=True))
        print(
            f"         requests whose completions equal the co-located ones (seeded): {same}/{len(runs['tuned'].tokens)}"
        )
        tuned = runs["tuned"]
        pairs.setdefault("cpu_tuned_over_even_throughput", {})[name] = (
            tuned.tokens_per_s,
            runs["even"].tokens_per_s,
        )
        pairs.setdefault("cpu_tuned_over_colocated_throughput", {})[name] = (
            tuned.tokens_per_s,
            runs["colocated"].tokens_per_s,
        )
        pairs.setdefault("cpu_tuned_over_even_p99_latency", {})[name] = (tuned.p99_s, runs["even"].p99_s)
    return pairs


if __name__ == "__main__":
    main()
