"""Traces across the whole loop, checked against one table of expected edges between services (in
the manner of the OpenTelemetry demo's telemetry tests).

A short run on a real local stack (`looprl up`), every service and Ray actor writing its finished
spans to one JSON-lines span log (LOOPRL_SPAN_LOG, passed through the environment). Every edge of
EDGES must be seen in that log, and no trace may hold more than MAX_TRACE_SPANS spans: each episode
task, step and weight delivery is its own trace, so no trace grows with the length of the run.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.runs import assert_accounting, run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE, local_stack

pytestmark = pytest.mark.slow

STEPS = 150  # the length the bound must hold for: no trace may grow with the run

# The largest trace allowed. An episode trace of the default recipe holds ~20 spans (episode, a
# Generate per turn as client + router server + router client + replica server, the reward calls,
# the rollout publishes and the packer's consumes); a trainer step trace holds the step, both ranks'
# (this test trains with two) NextBatch and PushShards (client and server), the packer's step build, AckStep and the record
# publish with the gateway's processing of it. Measured: the largest trace of a 150-step run holds
# 24 spans (as of a 20-step one). Before episodes were traces of their own, the run's trace held every
# task publish and episode of the run: 604 spans for 20 steps, growing with every step.
MAX_TRACE_SPANS = 80


@dataclass(frozen=True)
class Edge:
    """`parent` -> `child`: a parent/child edge (child's parent span is the parent) or a link edge
    (the child span carries a link to the parent span). Names are regular expressions."""

    kind: str  # "child" or "link"
    parent_service: str
    parent_name: str
    child_service: str
    child_name: str
    why: str


RUN = r"looprl\.[^.]+"
EDGES = [
    # the run's trace: lifecycle only; each step's feed is its own trace linked to it
    Edge(
        "child",
        "gateway",
        r".*GatewayService/CreateRun",
        "gateway",
        r"run started",
        "the run's trace holds its lifecycle",
    ),
    Edge(
        "link",
        "gateway",
        r".*GatewayService/CreateRun",
        "gateway",
        r"feed step",
        "a step's feed links to its run",
    ),
    Edge(
        "child",
        "gateway",
        r"feed step",
        "gateway",
        rf"{RUN}\.episodes publish",
        "a step's tasks are published in its feed",
    ),
    # gateway -> environment-sandbox: each episode task starts its own trace, linked to its publish
    Edge(
        "link",
        "gateway",
        rf"{RUN}\.episodes publish",
        "environment-sandbox",
        r"episode",
        "an episode task is a trace of its own",
    ),
    # environment-sandbox -> inference-router Generate -> replica
    Edge(
        "child",
        "environment-sandbox",
        r"episode",
        "environment-sandbox",
        r".*InferenceRouterService/Generate",
        "every model turn (client span)",
    ),
    Edge(
        "child",
        "environment-sandbox",
        r".*InferenceRouterService/Generate",
        "inference-router",
        r".*InferenceRouterService/Generate",
        "the router serves it",
    ),
    Edge(
        "child",
        "inference-router",
        r".*InferenceRouterService/Generate",
        "inference-router",
        r".*InferenceEngineService/Generate|replica generate",
        "the router asks a replica",
    ),
    Edge(
        "child",
        "inference-router",
        r".*InferenceEngineService/Generate",
        "inference-replica",
        r".*InferenceEngineService/Generate",
        "the replica generates (engine time)",
    ),
    # environment-sandbox -> reward
    Edge(
        "child",
        "environment-sandbox",
        r"episode",
        "environment-sandbox",
        r"score batch",
        "an episode's reward call (batched with the episodes finishing alongside)",
    ),
    Edge(
        "child",
        "environment-sandbox",
        r"score batch",
        "environment-sandbox",
        r".*RewardService/Score(Batch)?",
        "the batch's call (client span)",
    ),
    Edge(
        "child",
        "environment-sandbox",
        r".*RewardService/Score(Batch)?",
        "reward",
        r".*RewardService/Score(Batch)?",
        "the reward service scores",
    ),
    # environment-sandbox -> rollout-packer: the consume is in the rollout's trace
    Edge(
        "child",
        "environment-sandbox",
        r"episode",
        "environment-sandbox",
        rf"{RUN}\.rollouts publish",
        "the rollout publish is inside the episode",
    ),
    Edge(
        "child",
        "environment-sandbox",
        rf"{RUN}\.rollouts publish",
        "rollout-packer",
        rf"{RUN}\.rollouts process",
        "the packer takes the rollout in",
    ),
    # rollout-packer step -> rollouts, trainer step -> rollouts and NextBatch
    Edge(
        "link",
        "environment-sandbox",
        rf"{RUN}\.rollouts publish",
        "rollout-packer",
        r"packer step",
        "a step links to the rollouts it packs",
    ),
    Edge(
        "link",
        "environment-sandbox",
        rf"{RUN}\.rollouts publish",
        "trainer",
        r"trainer step",
        "a trainer step links to the rollouts it trains",
    ),
    Edge(
        "child",
        "trainer",
        r"trainer step",
        "trainer",
        r".*RolloutPackerService/NextBatch",
        "every rank pulls its micro-batches (client span in the rank's actor)",
    ),
    Edge(
        "child",
        "trainer",
        r".*RolloutPackerService/NextBatch",
        "rollout-packer",
        r".*RolloutPackerService/NextBatch",
        "the packer serves them",
    ),
    Edge(
        "child",
        "rollout-packer",
        r".*RolloutPackerService/NextBatch",
        "rollout-packer",
        r"packer step",
        "the first rank's pull builds the step",
    ),
    # trainer -> weight-sync PushShards -> replica StageWeights (committing)
    Edge(
        "child",
        "trainer",
        r"trainer step",
        "trainer",
        r".*WeightSyncService/PushShards",
        "every rank pushes the new version",
    ),
    Edge(
        "child",
        "trainer",
        r".*WeightSyncService/PushShards",
        "weight-sync",
        r".*WeightSyncService/PushShards",
        "weight-sync receives it",
    ),
    Edge(
        "link",
        "weight-sync",
        r".*WeightSyncService/PushShards",
        "weight-sync",
        r"weight-sync deliver",
        "a delivery links to the pushes (the trainer step) of its version",
    ),
    Edge(
        "child",
        "weight-sync",
        r"weight-sync deliver",
        "weight-sync",
        r".*InferenceEngineService/StageWeights",
        "the delivery stages every bucket (client span)",
    ),
    Edge(
        "child",
        "weight-sync",
        r".*InferenceEngineService/StageWeights",
        "inference-replica",
        r".*InferenceEngineService/StageWeights",
        # The recipe's one replica of one rank commits as its last bucket lands: no CommitWeights.
        "the replica stages, and commits the version inside its last StageWeights",
    ),
    # the trainer's step record reaches the gateway inside the step's trace
    Edge(
        "child",
        "trainer",
        rf"{RUN}\.train publish",
        "gateway",
        rf"{RUN}\.train process",
        "the gateway follows the step",
    ),
]

# Deliberate gaps: edges a reader might expect that are not there, and why.
GAPS = {
    "gateway CreateRun -> episodes (parent)": "a run would be one trace growing with every step",
    "episode -> packer step (parent)": "a step holds many rollouts and a rollout one step: links",
    "inference-router -> replica status polls": "Ray actor calls without spans: periodic and "
    "uninteresting, they would make a trace each",
    "trainer version 0 push": "pushed at start outside any step: its PushShards client spans are roots",
    "weight-sync deliver -> trainer step (parent)": "a delivery may run later or again (RequestSync, "
    "a restarted replica): linked, its own trace",
    "score batch of several episodes": "one call, in the first episode's trace, linked to the others",
}


def _load(span_log: Path) -> list[dict]:
    return [json.loads(line) for line in span_log.read_text().splitlines() if line.strip()]


def _matches(span: dict, service: str, name: str) -> bool:
    return span["service"] == service and re.fullmatch(name, span["name"]) is not None


def _edge_seen(edge: Edge, spans: list[dict], by_id: dict[str, dict]) -> bool:
    for child in spans:
        if not _matches(child, edge.child_service, edge.child_name):
            continue
        if edge.kind == "child":
            targets = [by_id.get(child["parent_span_id"])]
        else:
            targets = [by_id.get(link["span_id"]) for link in child.get("links", [])]
        if any(t is not None and _matches(t, edge.parent_service, edge.parent_name) for t in targets):
            return True
    return False


def test_every_edge_of_the_table_is_traced_and_no_trace_grows_with_the_run(tmp_path, monkeypatch) -> None:
    span_log = tmp_path / "spans.jsonl"
    monkeypatch.setenv("LOOPRL_SPAN_LOG", str(span_log))
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": STEPS}, trainer={"world_size": 2})
    (tmp_path / "stack").mkdir()
    with local_stack(tmp_path / "stack") as stack:
        run = run_to_end(stack.stub, stack.metadata, recipe, "e2e-traced", timeout=600)
        assert_accounting(run)
    spans = _load(span_log)  # `looprl down` flushed every service
    by_id = {s["span_id"]: s for s in spans}

    missing = [e for e in EDGES if not _edge_seen(e, spans, by_id)]
    seen = sorted({(s["service"], s["name"]) for s in spans})
    assert not missing, (
        "edges not traced:\n"
        + "\n".join(
            f"  {e.parent_service}:{e.parent_name} -{e.kind}-> {e.child_service}:{e.child_name} ({e.why})"
            for e in missing
        )
        + "\ndeliberate gaps: "
        + "; ".join(f"{gap} ({why})" for gap, why in GAPS.items())
        + "\nspans seen: "
        + ", ".join(f"{svc}:{name}" for svc, name in seen)
    )

    # Every version the run trained was committed inside a replica's StageWeights span, which names it.
    committed = {
        s["attributes"].get("looprl.weight_version")
        for s in spans
        if s["service"] == "inference-replica" and s["name"].endswith("InferenceEngineService/StageWeights")
    }
    assert {str(v) for v in range(STEPS)} <= committed, sorted(committed - {None}, key=int)[-5:]

    sizes = Counter(s["trace_id"] for s in spans)
    largest, count = sizes.most_common(1)[0]
    names = Counter(s["name"] for s in spans if s["trace_id"] == largest).most_common(5)
    print(f"traces: {len(sizes)}, spans: {len(spans)}, largest trace: {count} spans {names}")
    assert count <= MAX_TRACE_SPANS, f"trace {largest} holds {count} spans (> {MAX_TRACE_SPANS}): {names}"

    # one trace per episode task, each holding its task's rollouts and their consumes by the packer
    episodes = [s for s in spans if s["name"] == "episode" and s["service"] == "environment-sandbox"]
    assert episodes and all(not e["parent_span_id"] for e in episodes)
    per_trace = defaultdict(list)
    for s in spans:
        per_trace[s["trace_id"]].append(s)
    played = [e for e in episodes if e["status"] != "ERROR"]  # a failed try is retried, publishes nothing
    assert len(played) >= STEPS
    for episode in played[:40]:
        trace_spans = per_trace[episode["trace_id"]]
        assert sum(1 for s in trace_spans if s["name"] == "episode") == 1
        assert any(s["name"].endswith(".rollouts process") for s in trace_spans), "no packer consume"
    # every trainer step links to rollouts and carries the attributes a reader filters on
    steps = [s for s in spans if s["name"] == "trainer step"]
    assert len(steps) >= STEPS
    for step in steps:
        assert step["links"], f"trainer step {step['attributes']} links to no rollout"
        for key in ("looprl.run_id", "looprl.step", "looprl.weight_version", "looprl.tokens"):
            assert key in step["attributes"], f"trainer step lacks {key}"
