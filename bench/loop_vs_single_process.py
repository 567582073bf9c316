"""The whole service loop vs a single-process GRPO script doing the same work: what the boundaries cost.

Both sides run the same recipe (same model, environment, sampling, batch, loss and optimizer) for the
same number of steps on the same machine, and are compared on trained tokens per second: all tokens
of the packed micro-batches the optimizer stepped on (prompt + completion), divided by the wall time
of whole steps (generate, score, pack, train, weight update), the first step (warm-up) excluded.

Two workloads, both configs/digits_grpo.toml (64 rollouts of 4-token answers per step):
- "small": the recipe with model.preset = "small-qwen2" (3.5M parameters, ~0.55 s of work per step
  in one process). Figure tokens_per_s_ratio, target: the loop reaches >= 0.7x of the single process
  on 2 cores.
- "tiny": the recipe as `make run` uses it (tiny-qwen2, 0.1M parameters, ~0.07 s per step). Here
  a step is almost nothing but the fixed cost of crossing the services (NATS, gRPC, Ray: ~6 process
  hops a step), so this ratio measures that cost rather than the loop's efficiency on real work.
  Figure tokens_per_s_ratio_tiny_model (reference, no target), plus boundary_ms_per_step: the
  loop's step time minus the single process's on this workload.

Baseline (this file): bench/single_process_grpo.py in this process, run with 1 and with 2 torch
threads (every core the loop may use), the faster counting: the baseline is the best single process.

Measured path: the service loop (gateway + every service as its own process on a local stack),
`measure_service_loop`, measured with the same definition, with 1 and with 2 trainer ranks (how many
ranks train is a deployment choice, like the baseline's threads; the algorithm is the same), the
faster counting.

Past one machine the loop scales where the single process cannot: generation replicas and sandbox
workers on their own nodes, trainer ranks on their own GPUs, weight-sync fan-out by shared memory
per host; the single process is bound to one device and does one phase at a time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench.common import emit
from bench.single_process_grpo import DEFAULT_RECIPE, GRPOSettings, run_sync, summarize

BENCH = "loop_vs_single_process"


@dataclass
class Throughput:
    """One side of the comparison, measured over `steps` steps (the warm-up step excluded from rates)."""

    label: str
    steps: int
    wall_seconds: float
    trained_tokens_per_s: float
    steps_per_s: float
    first_reward: float
    last_reward: float


def measure_single_process(
    recipe: str | Path = DEFAULT_RECIPE, steps: int | None = None, threads: int = 2, seed: int | None = None
) -> Throughput:
    """The baseline: the recipe's loop in one Python process (no services, no Ray, no NATS)."""
    overrides: dict = {"threads": threads}
    if steps is not None:
        overrides["steps"] = steps
    if seed is not None:
        overrides["seed"] = seed
    settings = GRPOSettings.from_recipe(recipe, **overrides)
    s = summarize(run_sync(settings))
    return Throughput(
        label="single process",
        steps=int(s["steps"]),
        wall_seconds=s["wall_seconds"],
        trained_tokens_per_s=s["trained_tokens_per_s"],
        steps_per_s=s["steps_per_s"],
        first_reward=s["first_reward"],
        last_reward=s["last_reward"],
    )


def measure_service_loop(recipe: str | Path, steps: int, world_size: int | None = None) -> Throughput:
    """The measured path: the recipe through a real local stack (every service its own process),
    with the trainer's ranks overridden to `world_size` when given."""
    from bench.loop_harness import run_on_fresh_stack, with_overrides

    overrides: dict = {"run": {"steps": steps}}
    if world_size is not None:
        overrides["trainer"] = {"world_size": world_size}
    result = run_on_fresh_stack(with_overrides(Path(recipe).read_text(), **overrides), "bench-loop")
    rewards = [h.reward_mean for h in result.run.history]
    return Throughput(
        label=f"loop ranks={world_size}" if world_size else "service loop",
        steps=len(rewards),
        wall_seconds=result.wall_seconds,
        trained_tokens_per_s=result.trained_tokens_per_second,
        steps_per_s=result.steps_per_second,
        first_reward=sum(rewards[:3]) / min(3, len(rewards)),
        last_reward=sum(rewards[-3:]) / min(3, len(rewards)),
    )


def _row(t: Throughput) -> str:
    return (
        f"{t.label:<16} {t.steps:>5} {t.wall_seconds:>8.1f} {t.trained_tokens_per_s:>10.0f} "
        f"{t.steps_per_s:>8.2f} {t.first_reward:>8.3f} {t.last_reward:>8.3f}"
    )


@dataclass
class Workload:
    name: str
    recipe_text: str
    steps: int
    figure: str
    target: str


def compare(work: Workload, threads: list[int], world_sizes: list[int]) -> tuple[Throughput, Throughput]:
    """(best single process, best service loop) on one workload, every try printed."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(work.recipe_text)
    recipe = Path(f.name)
    try:
        tries = [measure_single_process(recipe, work.steps, threads=t) for t in threads]
        for t, result in zip(threads, tries, strict=True):
            result.label = f"single proc t={t}"
        single = max(tries, key=lambda r: r.trained_tokens_per_s)
        loops = [measure_service_loop(recipe, single.steps, world_size=w) for w in world_sizes]
    finally:
        recipe.unlink()
    loop = max(loops, key=lambda r: r.trained_tokens_per_s)
    print(f"-- {work.name}")
    print(f"{'path':<16} {'steps':>5} {'wall s':>8} {'tok/s':>10} {'steps/s':>8} {'first3':>8} {'last3':>8}")
    for result in [*tries, *loops]:
        print(_row(result))
    return single, loop


def main() -> None:
    from bench.loop_harness import with_overrides

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    p.add_argument("--steps", type=int, help="steps of the tiny workload (default 150; --quick 8)")
    p.add_argument("--small-steps", type=int, help="steps of the small workload (default 40; --quick 6)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads to try")
    p.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2], help="trainer ranks to try in the loop"
    )
    args = p.parse_args()
    text = Path(args.recipe).read_text()
    small = Workload(
        "small: small-qwen2 (3.5M parameters)",
        with_overrides(text, model={"preset": "small-qwen2"}),
        args.small_steps or (6 if args.quick else 40),
        "tokens_per_s_ratio",
        ">= 0.7x of the single process on 2 cores",
    )
    tiny = Workload(
        "tiny: the recipe as is (tiny-qwen2, 0.1M parameters)",
        text,
        args.steps or (8 if args.quick else 150),
        "tokens_per_s_ratio_tiny_model",
        "reference: per-step fixed cost dominates",
    )
    results = {w.figure: (w, *compare(w, args.threads, args.world_sizes)) for w in (small, tiny)}
    for work, single, loop in results.values():
        emit(
            BENCH,
            work.figure,
            loop.trained_tokens_per_s,
            single.trained_tokens_per_s,
            loop.trained_tokens_per_s / max(single.trained_tokens_per_s, 1e-9),
            "tokens/s",
            work.target,
        )
    _, single, loop = results[tiny.figure]
    boundary_ms = 1000 * (1 / loop.steps_per_s - 1 / single.steps_per_s)
    emit(
        BENCH,
        "boundary_ms_per_step",
        boundary_ms,
        None,
        None,
        "ms",
        "reference: loop step - single step (tiny)",
    )


if __name__ == "__main__":
    main()
