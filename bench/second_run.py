"""What a second run on the same stack costs the first: the default recipe's steps/s alone, and with
a second run of the same recipe training beside it (each on its own deployment and rank group).

Reported, no target: on this 2-core machine two runs share the same two cores, so the second run's
cost is mostly CPU contention; the figure shows what the platform adds on top of that.

    python -m bench.second_run [--quick]
"""

from __future__ import annotations

import threading

from bench.common import emit, parse_args
from bench.loop_harness import ROOT, RunResult, local_stack, run_recipe, with_overrides

# One trainer rank per run: two runs of two FSDP ranks would ask for four busy processes of 2 cores.
WORLD_SIZE = 1


def main() -> None:
    args = parse_args(__doc__)
    steps = 10 if args.quick else 60
    rounds = 1 if args.quick else 2
    base = (ROOT / "configs" / "digits_grpo.toml").read_text()
    recipe = with_overrides(base, run={"steps": steps}, trainer={"world_size": WORLD_SIZE})
    alone: list[RunResult] = []
    beside: list[RunResult] = []
    # One stack for every run (each brings its own deployment); a short run first warms it up.
    # Each run's first step (its replica and ranks starting) is excluded from its steps/s.
    with local_stack(None) as (stub, metadata):
        run_recipe(stub, metadata, with_overrides(recipe, run={"steps": 3}), "bench-warm-up")
        for round_ in range(rounds):
            alone.append(run_recipe(stub, metadata, recipe, f"bench-alone-{round_}"))
            # The second run is longer, so it trains beside every step of the measured one.
            longer = with_overrides(recipe, run={"steps": steps + 20})
            other = threading.Thread(
                target=run_recipe, args=(stub, metadata, longer, f"bench-other-{round_}")
            )
            other.start()
            beside.append(run_recipe(stub, metadata, recipe, f"bench-first-{round_}"))
            other.join()
    print(f"{'run':<24}{'steps':>6}{'seconds':>10}{'steps/s':>10}")
    for name, results in (("alone", alone), ("beside a second run", beside)):
        for r in results:
            print(f"{name:<24}{len(r.run.history):>6}{r.wall_seconds:>10.1f}{r.steps_per_second:>10.3f}")
    solo = max(r.steps_per_second for r in alone)
    shared = max(r.steps_per_second for r in beside)
    emit("second_run", "steps_per_s_with_a_second_run", shared, solo, shared / solo, "steps/s", "reported")


if __name__ == "__main__":
    main()
