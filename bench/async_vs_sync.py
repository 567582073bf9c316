"""Asynchronous (max_staleness 2) vs synchronous (max_staleness 0) steps/s on the same recipe,
through the real service loop. With staleness > 0 the gateway feeds the next steps' episodes while
the trainer trains, so generation overlaps training.

    python -m bench.async_vs_sync [--quick]
"""

from __future__ import annotations

from bench.common import emit, parse_args
from bench.loop_harness import ROOT, local_stack, run_recipe, with_overrides


def main() -> None:
    args = parse_args(__doc__)
    steps = 8 if args.quick else 20
    base = (ROOT / "configs" / "digits_grpo.toml").read_text()
    results = {}
    with local_stack(base) as (stub, metadata):
        # Warm-up: first-run costs (Ray worker start, imports, plans) are paid once, outside both.
        run_recipe(stub, metadata, with_overrides(base, run={"steps": 2, "max_staleness": 0}), "warmup")
        for staleness in (0, 2):
            recipe = with_overrides(base, run={"steps": steps, "max_staleness": staleness})
            results[staleness] = run_recipe(stub, metadata, recipe, f"bench-staleness-{staleness}")
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
