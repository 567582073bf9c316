"""Asynchronous (max_staleness 2) vs synchronous (max_staleness 0) steps/s on the same recipe,
through the real service loop. With staleness > 0 the gateway feeds the next steps' episodes while
the trainer trains, so generation overlaps training.

    python -m bench.async_vs_sync [--quick]
"""

from __future__ import annotations

from bench.common import emit, parse_args
from bench.loop_harness import ROOT, run_on_fresh_stack, with_overrides

# One trainer rank on both sides: the faster synchronous configuration on 2 cores (see
# bench/loop_vs_single_process.py), and the one where training leaves a core for generation to
# overlap with. Two FSDP ranks would hold both cores during every training step.
WORLD_SIZE = 1


def main() -> None:
    args = parse_args(__doc__)
    steps = 10 if args.quick else 100
    rounds = 1 if args.quick else 2
    base = (ROOT / "configs" / "digits_grpo.toml").read_text()
    runs: dict[int, list] = {0: [], 2: []}
    # One stack per run (a stack serves one run); each run's first step is its warm-up and is
    # excluded from its steps/s. Sides alternate, and each counts its best round, so a disturbance
    # on the shared machine does not decide the ratio.
    for round_ in range(rounds):
        for staleness in (0, 2):
            recipe = with_overrides(
                base, run={"steps": steps, "max_staleness": staleness}, trainer={"world_size": WORLD_SIZE}
            )
            runs[staleness].append(run_on_fresh_stack(recipe, f"bench-staleness-{staleness}-{round_}"))
    print(f"{'mode':<28}{'steps':>6}{'seconds':>10}{'steps/s':>10}{'reward(last)':>14}")
    for staleness, name in ((0, "sync (max_staleness 0)"), (2, "async (max_staleness 2)")):
        for r in runs[staleness]:
            print(
                f"{name:<28}{len(r.run.history):>6}{r.wall_seconds:>10.1f}{r.steps_per_second:>10.3f}"
                f"{r.run.history[-1].reward_mean:>14.3f}"
            )
    sync = max(r.steps_per_second for r in runs[0])
    asyn = max(r.steps_per_second for r in runs[2])
    rounds_ratio = [a.steps_per_second / s.steps_per_second for a, s in zip(runs[2], runs[0], strict=True)]
    emit(
        "async_vs_sync",
        "steps_per_s_ratio",
        asyn,
        sync,
        asyn / sync,
        "steps/s (best round of each side)",
        ">= 1.3",
        samples=rounds_ratio,
    )


if __name__ == "__main__":
    main()
