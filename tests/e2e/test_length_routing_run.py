"""Requests of a run spread over its deployments by predicted output length, on a live stack.

The run's tasks come from two sources of one dataset (tests/support/two_sources.py): "brief"
problems the model answers in a few tokens and "worked" ones it answers at length, under the same
sampling settings (max_tokens 512 for both). The environment-sandbox predicts each request's output
length per source from the completions it has seen (services/decisions/length_prediction.py) and
sends it as GenerateRequest.expected_output_tokens; the router routes by it. What each request was
routed to comes from the run's rollouts on the bus (every model turn names its deployment).

1. A run with a deployment for short outputs and one for long ones: each source lands on its own
   deployment (>= 90% of the requests routed by a predicted length). The first step's
   requests, sent before predictions settle, are printed only.
2. configs/gpu_vllm_gsm8k.toml's two deployments, on the CPU backend with the recipe's own length
   profiles (short <= 384 output tokens, long >= 384) and sampling.max_tokens: both serve the run.
"""

from __future__ import annotations

import asyncio
import tomllib
import urllib.request
from collections import Counter
from pathlib import Path

import nats.errors
import pytest

from looprl.common.v1 import common_pb2
from services.kit.bus import nats_auth, subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import run_deployment_name
from services.kit.messages import rollouts as rollout_messages
from tests.support.runs import assert_accounting, run_to_end
from tests.support.stack import Stack, local_stack
from tests.support.two_sources import (
    BRIEF,
    WORKED,
    build_two_source_model,
    source_of,
    two_source_rows,
    write_rows,
)
from tools.gpu_check_plan import to_toml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPE = ROOT / "configs" / "gpu_vllm_gsm8k.toml"


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, dataset of both sources): built once for the module."""
    base = tmp_path_factory.mktemp("two-sources")
    build_two_source_model(base / "model")
    return base / "model", write_rows(base / "tasks.jsonl", two_source_rows(64, seed=0))


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Stack:
    with local_stack(tmp_path_factory.mktemp("stack"), recipe_text=None) as stack:
        yield stack


def _recipe(name: str, model: Path, dataset: Path, steps: int, deployments: list[dict]) -> str:
    return to_toml(
        {
            "run": {"name": name, "seed": 0, "steps": steps},
            "model": {"path": str(model), "tokenizer": str(model)},
            "environment": {"name": "math", "reward": "math", "config": {"dataset": str(dataset)}},
            "sampling": {"temperature": 1.0, "max_tokens": 512},
            "batch": {"rollouts_per_step": 32, "group_size": 4, "max_tokens_per_microbatch": 8192},
            "optimizer": {"lr": 1e-6},  # the run shows routing; its policy should stay as taught
            "trainer": {"world_size": 1, "checkpoint_every": 0},
            "deployments": deployments,
        }
    )


def _requests(stack: Stack, run_id: str) -> list[tuple[int, str, str, int]]:
    """(step, source, deployment, mean completion tokens) of each request of the run: a group's
    samples are one request (one prefill, n completions), read back from its rollouts on the bus."""

    async def read() -> list[common_pb2.Rollout]:
        bus = await Bus.connect(stack.state.nats_url_for(nats_auth.OPERATOR), name="e2e-length-routing")
        try:
            sub = await bus.js.subscribe(subjects.rollouts(run_id), ordered_consumer=True)
            rollouts: list[common_pb2.Rollout] = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=2.0)
                except nats.errors.TimeoutError:
                    return rollouts
                rollouts += rollout_messages.decode(msg.data, msg.headers)
        finally:
            await bus.close()

    groups: dict[str, list[common_pb2.Rollout]] = {}
    for rollout in asyncio.run(read()):
        groups.setdefault(rollout.group_id, []).append(rollout)
    out = []
    for members in groups.values():
        prompt = members[0].turns[0].text
        answers = [next(t for t in r.turns if t.trainable) for r in members]
        (deployment,) = {a.deployment for a in answers}
        step = int(members[0].group_id.rsplit(".s", 1)[1].split(".")[0])  # <run>.s<step>.g<group>
        mean = sum(len(a.token_ids) for a in answers) // len(answers)
        out.append((step, source_of(prompt), deployment, mean))
    return out


def _router_metric(stack: Stack, name: str, labels: dict[str, str]) -> float:
    port = stack.state.service("inference-router").metrics_port
    with urllib.request.urlopen(f"http://{stack.state.host}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(900)
def test_each_source_goes_to_the_deployment_its_predicted_length_fits(platform, two_sources) -> None:
    model, dataset = two_sources
    deployments = [
        {"name": "terse", "max_model_len": 1024, "max_batch_size": 32, "max_output_tokens": 64},
        {"name": "verbose", "max_model_len": 1024, "max_batch_size": 32, "min_output_tokens": 65},
    ]
    run_id = "two-sources"
    run = run_to_end(
        platform.stub, platform.metadata, _recipe(run_id, model, dataset, 8, deployments), run_id, 600
    )
    assert_accounting(run)
    requests = _requests(platform, run_id)
    assert len(requests) == 8 * 8  # 8 steps of 8 groups, one request each
    home = {BRIEF: run_deployment_name(run_id, "terse"), WORKED: run_deployment_name(run_id, "verbose")}
    # The first step's requests are printed, not asserted: where they go varies from run to run
    # (all on verbose, or all on terse), which docs/inference.md lists as an open question.
    unpredicted = [r for r in requests if r[0] == 0]
    predicted = [r for r in requests if r[0] > 0]
    by_source = Counter(source for _, source, _, _ in predicted)
    matched = Counter(source for _, source, deployment, _ in predicted if deployment == home[source])
    lengths = {s: sorted(n for _, src, _, n in predicted if src == s) for s in (BRIEF, WORKED)}
    print(
        "routed by predicted length: "
        + ", ".join(f"{s} {matched[s]}/{by_source[s]} on {home[s]}" for s in (BRIEF, WORKED))
        + f"; first step: {Counter(d for _, _, d, _ in unpredicted)}"
    )
    for source in (BRIEF, WORKED):
        share = matched[source] / by_source[source]
        assert share >= 0.9, (
            f"{source}: {matched[source]} of {by_source[source]} requests on {home[source]}; "
            f"their mean completion lengths: {lengths[source]}"
        )
    # The router measured each completion against the profile it was routed to by its prediction.
    fits = _router_metric(
        platform,
        "looprl_router_length_predictions_total",
        {"deployment": home[BRIEF], "outcome": "in_profile"},
    )
    assert fits > 0


@pytest.mark.timeout(900)
def test_the_gpu_recipes_two_deployments_both_serve_a_run_on_the_cpu_backend(platform, two_sources) -> None:
    model, dataset = two_sources
    recipe = tomllib.loads(GPU_RECIPE.read_text())
    profile_fields = (
        "name",
        "min_prompt_tokens",
        "max_prompt_tokens",
        "min_output_tokens",
        "max_output_tokens",
    )
    deployments = [
        {
            **{k: v for k, v in d.items() if k in profile_fields},
            "backend": "cpu",
            "max_model_len": 1024,
            "max_batch_size": 32,
        }
        for d in recipe["deployments"]
    ]
    assert [d["name"] for d in deployments] == ["short", "long"]
    assert deployments[0]["max_output_tokens"] == deployments[1]["min_output_tokens"] == 384
    assert recipe["sampling"]["max_tokens"] == 512  # what the test samples with too
    run_id = "gpu-recipe-on-cpu"
    run = run_to_end(
        platform.stub, platform.metadata, _recipe(run_id, model, dataset, 6, deployments), run_id, 600
    )
    assert_accounting(run)
    served = Counter(deployment for _, _, deployment, _ in _requests(platform, run_id))
    print(f"the GPU recipe's deployments served: {dict(served)}")
    for name in ("short", "long"):
        assert served[run_deployment_name(run_id, name)] > 0, f"{name} served nothing: {dict(served)}"
