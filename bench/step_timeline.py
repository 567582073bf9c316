"""Where a synchronous step goes: the recipe on a fresh local stack, every service writing its spans to
one span log, and each trainer step lined up on its own start.

Per step s (the trainer's "trainer step" span of step s, which trains version s into s+1):
- commit: version s committed on a replica (CommitWeights, or the StageWeights call that completed
  it on a replica that commits on its own; pushed by step s-1),
- generation: the replicas' Generate spans at version s, first start (or the commit, for requests
  the replica held for it) to last end,
- batch: the trainer's NextBatch for step s returns (generation, reward, publish and packing done),
- update: from the batch to the push of version s+1 (forward, backward, optimizer),
- push: the trainer's PushShards of version s+1.
Printed as medians over the steps (the first five and the last excluded: warm-up and shutdown).

Figures (reference, no target): `hops_ms_per_step`, the step minus the two compute parts (generation
at the replicas and the update), against the whole step; `generation_ms_per_step` and
`update_ms_per_step`, each against the whole step. What is not compute is crossing the services.
And `step_record_lag_ms` (target < 50 ms): the longest any step record past the first five took
from the trainer's publish to the gateway's handling of it, against the whole step. A record the gateway sees late
reports the run's progress late and feeds the next step late.

    python -m bench.step_timeline [--steps 60] [--world-size 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import emit

BENCH = "step_timeline"
STEP = "trainer step"
GENERATE = "looprl.inference.v1.InferenceEngineService/Generate"
COMMIT = "looprl.inference.v1.InferenceEngineService/CommitWeights"
# A lone replica commits inside the StageWeights call of its last bucket (that span then names the version).
STAGE = "looprl.inference.v1.InferenceEngineService/StageWeights"
NEXT_BATCH = "looprl.packer.v1.RolloutPackerService/NextBatch"
PUSH = "looprl.weightsync.v1.WeightSyncService/PushShards"
STEP_ATTR, VERSION_ATTR = "looprl.step", "looprl.weight_version"
RECORD_PUBLISH, RECORD_PROCESS = ".train publish", ".train process"
SKIP_FIRST = 5


@dataclass
class StepMoments:
    """One step, in ms after the trainer's step span starts."""

    step: float
    commit: float
    generation_start: float
    generation_end: float
    batch: float
    update: float
    push: float

    @property
    def generation(self) -> float:
        return self.generation_end - self.generation_start

    @property
    def hops(self) -> float:
        return self.step - self.generation - self.update


def step_moments(spans: Iterable[dict[str, Any]]) -> list[StepMoments]:
    """The moments of every step that has all of them (JSON span-log records, kit/telemetry/tracing.py)."""
    by_name: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault((span["service"], span["name"]), []).append(span)

    def at_version(service: str, name: str, version: str) -> list[dict[str, Any]]:
        return [s for s in by_name.get((service, name), []) if s["attributes"].get(VERSION_ATTR) == version]

    def inside(name: str, start: int, end: int) -> list[dict[str, Any]]:
        return sorted(
            (s for s in by_name.get(("trainer", name), []) if start <= s["start_ns"] <= end),
            key=lambda s: s["start_ns"],
        )

    steps = sorted(by_name.get(("trainer", STEP), []), key=lambda s: s["start_ns"])
    out = []
    for span in steps:
        start, end, version = span["start_ns"], span["end_ns"], span["attributes"].get(STEP_ATTR)
        generated = at_version("inference-replica", GENERATE, version)
        committed = at_version("inference-replica", COMMIT, version) or at_version(
            "inference-replica", STAGE, version
        )
        batches, pushes = inside(NEXT_BATCH, start, end), inside(PUSH, start, end)
        if not (generated and committed and batches and pushes):
            continue
        batch_end = max(s["end_ns"] for s in batches)
        commit_end = min(s["end_ns"] for s in committed)
        out.append(
            StepMoments(
                step=(end - start) / 1e6,
                commit=(commit_end - start) / 1e6,
                # A request held at the replica for this version (sent ahead) starts at the commit.
                generation_start=(max(min(s["start_ns"] for s in generated), commit_end) - start) / 1e6,
                generation_end=(max(s["end_ns"] for s in generated) - start) / 1e6,
                batch=(batch_end - start) / 1e6,
                update=(pushes[0]["start_ns"] - batch_end) / 1e6,
                push=(max(s["end_ns"] for s in pushes) - pushes[0]["start_ns"]) / 1e6,
            )
        )
    return out


def record_lags(spans: Iterable[dict[str, Any]]) -> list[float]:
    """ms from each step record's publish (trainer) to the start of its handling (gateway), in
    publish order: the handling span is the publish span's child."""
    spans = list(spans)
    published = {
        s["span_id"]: s for s in spans if s["service"] == "trainer" and s["name"].endswith(RECORD_PUBLISH)
    }
    lags = []
    for s in spans:
        parent = published.get(s.get("parent_span_id"))
        if parent is not None and s["service"] == "gateway" and s["name"].endswith(RECORD_PROCESS):
            lags.append((parent["end_ns"], (s["start_ns"] - parent["end_ns"]) / 1e6))
    return [lag for _, lag in sorted(lags)]


def medians(moments: list[StepMoments]) -> dict[str, float]:
    """Median of each moment (and of generation, hops) over the steady steps."""
    steady = moments[SKIP_FIRST:-1] if len(moments) > SKIP_FIRST + 1 else moments
    if not steady:
        raise ValueError("no step has every moment in the span log")
    names = ["commit", "generation_start", "generation_end", "batch", "update", "push", "generation", "hops"]
    out = {name: statistics.median(getattr(m, name) for m in steady) for name in names}
    out["step"] = statistics.median(m.step for m in steady)
    out["steps"] = len(steady)
    return out


def measure(steps: int, world_size: int) -> dict[str, float]:
    from bench.loop_harness import ROOT, run_on_fresh_stack, with_overrides

    recipe = with_overrides(
        (ROOT / "configs" / "digits_grpo.toml").read_text(),
        run={"steps": steps},
        trainer={"world_size": world_size},
    )
    with tempfile.TemporaryDirectory(prefix="looprl-timeline-") as tmp:
        log = Path(tmp) / "spans.jsonl"
        run_on_fresh_stack(recipe, "bench-timeline", env={"LOOPRL_SPAN_LOG": str(log)})
        spans = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    out = medians(step_moments(spans))
    lags = record_lags(spans)[SKIP_FIRST:]
    out["record_lag_max"] = max(lags) if lags else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=1, help="trainer ranks")
    args = parser.parse_args()
    m = measure(20 if args.quick else args.steps, args.world_size)
    print(
        f"medians over {m['steps']:.0f} steps, ms after the trainer's step starts ({args.world_size} ranks):"
    )
    for label, key in (
        ("version committed on the replica", "commit"),
        ("generation starts", "generation_start"),
        ("generation ends", "generation_end"),
        ("the batch reaches the trainer", "batch"),
        ("update (batch to push)", "update"),
        ("push", "push"),
        ("whole step", "step"),
    ):
        print(f"  {label:<36}{m[key]:8.1f}")
    for figure, key in (
        ("hops_ms_per_step", "hops"),
        ("generation_ms_per_step", "generation"),
        ("update_ms_per_step", "update"),
    ):
        emit(
            BENCH, figure, m[key], m["step"], m[key] / m["step"], "ms (baseline: the whole step)", "reference"
        )
    lag = m["record_lag_max"]
    emit(
        BENCH,
        "step_record_lag_ms",
        lag,
        m["step"],
        lag / m["step"],
        "ms, max (baseline: the whole step)",
        "< 50",
        checks="value",
    )


if __name__ == "__main__":
    main()
