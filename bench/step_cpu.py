"""Where a step's CPU goes: the default recipe on a fresh local stack, the CPU time (user + system,
from /proc) of each of the stack's processes over the run's middle steps, per step and by service,
against TRL's GRPOTrainer on the same recipe in this process (its own CPU time per step, every
torch thread included).

On a machine of N cores a synchronous step takes at least its CPU time over N, so this says how
much the crossings between services cost beside the compute they carry (bench/step_timeline says
when in the step they happen). It divides by steps run, so it holds still where wall time swings
with the host's load: compare services within one run. Processes are told apart by command line
(`-m services.<name>`, `-m gateway`, `ray::<Actor>`, nats-server, Ray's own daemons): run it on an
otherwise idle machine.

Figures (reference, no target): stack_cpu_ms_per_step (baseline: TRL's CPU per step on the same
recipe) and cpu_ms_per_step_<service> (baseline: the whole stack's).

    python -m bench.step_cpu [--steps 200] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

from bench.common import emit

BENCH = "step_cpu"


def service_of(cmdline: str) -> str | None:
    """The stack component a process belongs to, from its command line (None: not the stack's)."""
    if m := re.search(r"-m (?:services\.(\w+)|(gateway))\b", cmdline):
        return m.group(1) or m.group(2)
    if cmdline.startswith("ray::"):
        return cmdline.split()[0].removeprefix("ray::").split(".")[0]
    if "nats-server" in cmdline:
        return "nats-server"
    if "raylet" in cmdline or "gcs_server" in cmdline:
        return "ray"
    return None


def cpu_ms_by_process() -> dict[int, tuple[str, float]]:
    """Every stack process's (service, CPU ms used so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read().replace("\0", " ").strip()
        except OSError:  # ended meanwhile
            continue
        service = service_of(cmdline)
        if service is not None:
            fields = stat[stat.rfind(")") + 2 :].split()  # utime, stime: fields 14 and 15 of stat(5)
            out[int(pid)] = (service, (int(fields[11]) + int(fields[12])) * 1000 / tick)
    return out


def stack_cpu(steps: int) -> dict[str, float]:
    """CPU ms per step by service between 1/4 and 9/10 of a run of the default recipe."""
    from bench.loop_harness import ROOT, run_on_fresh_stack, with_overrides

    recipe = with_overrides((ROOT / "configs" / "digits_grpo.toml").read_text(), run={"steps": steps})
    marks = [steps // 4, steps * 9 // 10]
    snaps: list[tuple[int, dict[int, tuple[str, float]]]] = []

    def snap(run) -> None:
        if len(snaps) < len(marks) and run.step >= marks[len(snaps)]:
            snaps.append((run.step, cpu_ms_by_process()))

    run_on_fresh_stack(recipe, f"bench-cpu-{int(time.time())}", on_update=snap)
    (first, before), (last, after) = snaps
    used: dict[str, float] = {}
    for pid, (service, ms) in after.items():
        used[service] = used.get(service, 0.0) + ms - before.get(pid, (service, 0.0))[1]
    return {service: ms / (last - first) for service, ms in used.items()}


def trl_cpu(steps: int) -> float:
    """TRL's CPU ms per step over the same part of a run of the same recipe, in this process."""
    import torch
    from transformers import TrainerCallback

    from bench.peer_trl import TINY, trl_trainer, with_seed_and_steps
    from services.kit.config.recipe import parse_recipe

    torch.set_num_threads(2)  # as bench/peer_trl.py runs it
    recipe = parse_recipe(with_seed_and_steps(TINY.recipe_text(), 1, steps))
    marks: dict[int, float] = {}

    class CPUClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks[state.global_step] = time.process_time() * 1000

    with tempfile.TemporaryDirectory(prefix="looprl-step-cpu-") as out:
        trl_trainer(recipe, TINY, out, [CPUClock()]).train()
    first, last = steps // 4, steps * 9 // 10
    return (marks[last] - marks[first]) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 steps")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    steps = 40 if args.quick else args.steps
    trl = trl_cpu(steps)
    by_service = stack_cpu(steps)
    total = sum(by_service.values())
    emit(BENCH, "stack_cpu_ms_per_step", total, trl, total / trl, "ms CPU (baseline: TRL's)", "reference")
    for service, ms in sorted(by_service.items(), key=lambda kv: -kv[1]):
        if ms >= 0.1:
            emit(
                BENCH,
                f"cpu_ms_per_step_{service}",
                ms,
                total,
                ms / total,
                "ms CPU (baseline: the whole stack's)",
                "reference",
            )


if __name__ == "__main__":
    main()
