"""Parts written outside looprl, swapped in by configuration: the Node.js reward service and the
transformers engine of examples/ serve a run of the default recipe in place of looprl's reward
service and replicas (`looprl up --use`), and it learns; each passes its conformance kit. Once the
run is over, looprl's own router, weight-sync, environment-sandbox and trainer pass theirs on the
same stack (it now has weights to route to and no run to disturb: the kit's weight cases push and
commit versions of their own), and a broken router and weight-sync fail the case they break.

One stack and one 60-step run for all of it: the default recipe's reward leaves its start within a
few dozen steps (first 10 steps ~0.03, steps 50-60 ~0.07-0.10 on seeds 1-6, bench/single_process_grpo).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from looprl.gateway.v1 import gateway_pb2
from looprl.reward.v1 import reward_pb2, reward_pb2_grpc
from services.kit.rpc import tls
from tests.support.external_parts import hf_engine, install_node_reward, node_reward
from tests.support.kit_runs import assert_passes, broken_variant_fails, kit_cli
from tests.support.runs import assert_accounting, run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE, Stack, local_stack, looprl_cli

pytestmark = pytest.mark.slow

STEPS = 60
RECIPE = with_overrides(DEFAULT_RECIPE, run={"steps": STEPS})
RUN_ID = "swapped"


@dataclass
class Swapped:
    stack: Stack
    run: gateway_pb2.Run
    reward: str
    engine: str
    tls_dir: Path


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory):
    state_dir = tmp_path_factory.mktemp("swapped")
    node = install_node_reward()
    tls_dir = state_dir / "tls"
    # The stack's CA first (`looprl up` keeps it), and a certificate of its own for the engine.
    for args in (("certs", str(tls_dir)), ("certs", str(tls_dir), "--identity", "hf-engine")):
        done = looprl_cli(state_dir, *args)
        assert done.returncode == 0, done.stderr
    with (
        node_reward(node, tls_dir, state_dir / "node-reward.log") as reward,
        hf_engine(tls_dir, state_dir / "hf-engine.log") as engine,
    ):
        use = ("--use", f"reward={reward}", "--use", f"inference-engine={engine}")
        with local_stack(state_dir, RECIPE, up_args=use) as stack:
            run = run_to_end(stack.stub, stack.metadata, RECIPE, RUN_ID, timeout=600)
            yield Swapped(stack, run, reward, engine, tls_dir)


def test_the_default_recipe_learns_with_a_foreign_reward_and_engine(swapped: Swapped) -> None:
    run = swapped.run
    assert_accounting(run)
    rewards = [h.reward_mean for h in run.history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last >= 1.5 * first and last - first >= 0.015, (
        f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"
    )
    # Nothing of looprl's served them: no reward process, no replica of the router's own.
    names = [s.name for s in swapped.stack.state.services]
    assert "reward" not in names
    assert {d.deployment: d.version for d in run.deployments} == {"short-external-0": STEPS}
    status = swapped.stack.looprl("status")
    assert status.returncode == 0, status.stdout + status.stderr
    for role, address in (("reward", swapped.reward), ("inference-engine", swapped.engine)):
        line = next(line for line in status.stdout.splitlines() if line.startswith(f"{role} (external)"))
        assert "SERVING" in line and address in line and "external" in line.split()[-1]
    assert f"short-external-0=v{STEPS}" in status.stdout


def test_the_node_reward_passes_the_kit_and_scores_as_looprls_verifier(swapped: Swapped) -> None:
    assert_passes(kit_cli("reward", "--address", swapped.reward, "--tls-dir", str(swapped.tls_dir)))
    from services.reward.verifiers import ScoreInput, digits_partial_credit

    rng = random.Random(5)
    tasks, answers = [], []
    for _ in range(400):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
        tasks.append({"op": "rev", "digits": digits, "answer": digits[::-1]})
        answers.append("".join(rng.choice("0123456789 x") for _ in range(rng.randint(0, 5))))
    creds = tls.Credentials.from_dir("environment-sandbox", swapped.tls_dir)
    with tls.sync_channel(swapped.reward, creds=creds) as channel:
        reply = reward_pb2_grpc.RewardServiceStub(channel).ScoreBatch(
            reward_pb2.ScoreBatchRequest(
                requests=[
                    reward_pb2.ScoreRequest(reward="digits", task_json=json.dumps(t), completion=a)
                    for t, a in zip(tasks, answers, strict=True)
                ]
            ),
            timeout=30,
        )
    import asyncio

    expected = [
        asyncio.run(digits_partial_credit(ScoreInput(t, a))) for t, a in zip(tasks, answers, strict=True)
    ]
    assert [r.score for r in reply.responses] == expected  # bit for bit: the run above trained on them


def test_the_transformers_engine_passes_the_engine_kit(swapped: Swapped) -> None:
    # After the run: the kit stages and commits versions numbered after the one it serves.
    result = kit_cli(
        "inference-engine",
        "--address",
        swapped.engine,
        "--tls-dir",
        str(swapped.tls_dir),
        "--option",
        "max_model_len=128",
    )
    assert_passes(result)


@pytest.mark.parametrize("contract", ["inference-router", "environment-sandbox", "trainer", "weight-sync"])
def test_looprl_services_pass_their_kit_on_a_stack_with_weights(swapped: Swapped, contract: str) -> None:
    options = ("--option", f"run={RUN_ID}") if contract == "trainer" else ()
    result = kit_cli(contract, *options, state_dir=swapped.stack.state_dir)
    assert_passes(result)
    # Here the success paths ran too: generation, an episode through the foreign parts, deliveries.
    assert "SKIP" not in result.stdout.replace(
        "SKIP  environment-sandbox.exec.refused_without_isolation", ""
    ), result.stdout


@pytest.mark.parametrize("contract", ["inference-router", "weight-sync"])
def test_a_broken_router_or_weight_sync_fails_the_case_it_breaks(swapped: Swapped, contract: str) -> None:
    backend = swapped.stack.state.service(contract).address
    expected, failed = broken_variant_fails(contract, backend, swapped.tls_dir, contract)
    assert expected in failed, f"{contract}: the kit did not catch the mutation; failed: {failed}"
