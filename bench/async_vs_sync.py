"""Asynchronous (max_staleness 2) vs synchronous (max_staleness 0) steps/s on the same recipe,
through the real service loop. With staleness > 0 the gateway feeds the next steps' episodes while
the trainer trains, so generation overlaps training.

    python -m bench.async_vs_sync [--quick]
"""

from __future__ import annotations

from bench.common import emit, parse_args
from bench.loop_harness import ROOT, run_on_fresh_stack, with_overrides


def main() -> None:
    args = parse_args(__doc__)
    steps = 8 if args.quick else 20
    base = (ROOT / "configs" / "digits_grpo.toml").read_text()
    results = {}
    # One stack per run (a stack serves one run); each side's first step is its warm-up and is
    # excluded from its steps/s.
    for staleness in (0, 2):
        recipe = with_overrides(base, run={"steps": steps, "max_staleness": staleness})
        results[staleness] = run_on_fresh_stack(recipe, f"bench-staleness-{staleness}")
    sync, asyn = results[0], results[2]
    print(f"{'mode':<28}{'steps':>6}{'seconds':>10}{'steps/s':>10}{'reward(last)':>14}")
    for name, r in (("sync (max_staleness 0)", sync), ("async (max_staleness 2)", asyn)):
        print(
            f"{name:<28}{len(r.run.history):>6}{r.wall_seconds:>10.1f}{r.steps_per_second:>10.3f}{r.run.history[-1].reward_mean:>14.3f}"
        )
    emit(
        "async_vs_sync",
        "steps_per_s_ratio",
        asyn.steps_per_second,
        sync.steps_per_second,
        asyn.steps_per_second / sync.steps_per_second,
        "steps/s",
        ">= 1.3",
    )


if __name__ == "__main__":
    main()
