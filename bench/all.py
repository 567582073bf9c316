"""Run every benchmark in turn (`make bench`; BENCH_ARGS=--quick for the small sizes) and collect
the JSON figure lines of all of them at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

BENCHES = (
    "packing",
    "trainer_packing",
    "shared_prompts",
    "engine_batching",
    "router_overhead",
    "length_routing",
    "pd_disaggregation",
    "sim_fidelity",
    "sandbox_exec",
    "coding_env",
    "agent_loop",
    "rollout_messages",
    "weight_sync",
    "lora",
    "multihost_delivery",
    "async_vs_sync",
    "tracing_cost",
    "loop_vs_single_process",
    "step_timeline",
    "step_cpu",
    "second_run",
    "peer_trl",
)


def main() -> int:
    extra = sys.argv[1:]
    figures, failed = [], []
    for name in BENCHES:
        print(f"\n=== bench.{name} {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", f"bench.{name}", *extra], capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            failed.append(name)
            sys.stdout.write(proc.stderr[-4000:])
        figures += [line for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
        print(f"--- {name}: exit {proc.returncode} in {time.perf_counter() - start:.0f}s", flush=True)
    print("\n=== all figures")
    for line in figures:
        record = json.loads(line)
        print(json.dumps(record))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
