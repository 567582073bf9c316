"""End to end on the local stack: the user's own environments, rewards and datasets, and evaluation.

The plugins live outside the repository's packages: a temporary directory handed to the services
with `looprl up --plugin-dir` (their sys.path), and a distribution there that declares looprl entry
points (a .dist-info, as pip installs it). Runs train from a JSONL and a parquet file and their
reward rises; the shipped single-turn example runs as a user would run it, its held-out split is
evaluated during the run and `looprl eval` reproduces the figure of each evaluated step whose
export the trainer keeps; broken plugins fail the run within 10 s naming the plugin, its file and
line, and the cause.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from looprl.gateway.v1 import gateway_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.support.runs import run_to_end, with_overrides
from tests.support.stack import ROOT, Stack, local_stack

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
MULTI_TURN = (EXAMPLES / "multi_turn" / "recipe.toml").read_text()
SINGLE_TURN = (EXAMPLES / "single_turn" / "recipe.toml").read_text()
FAIL_S = 10.0
KEEP_EVAL_EXPORTS = 2

BROKEN = {
    # line 3 imports a module that does not exist
    "broken_import.py": "from services.environment_sandbox.environments import Environment\n\nimport no_such_module\n",
    "bad_rewards.py": """import math


def raises(prompt, completion, answer, **metadata):
    return 1 / 0


def nan(prompt, completion, answer, **metadata):
    return math.nan


def text(prompt, completion, answer, **metadata):
    return "good"


def raises_on_model_output(prompt, completion, answer, **metadata):
    if completion not in ("", answer):
        raise KeyError("no such key in the scoring table")
    return 0.0
""",
}
DIST_INFO = "looprl_demo_plugins-0.1.dist-info"
ENTRY_POINTS = """[looprl.environments]
relay = looprl_demo_plugins:Relay

[looprl.rewards]
digit_score = looprl_demo_plugins:score
"""


def _plugin_dirs(root: Path) -> tuple[Path, Path]:
    """A directory of plugin files, and one holding an installed distribution with entry points."""
    files = root / "plugins"
    files.mkdir()
    shutil.copy(EXAMPLES / "multi_turn" / "envs.py", files / "my_envs.py")
    shutil.copy(EXAMPLES / "single_turn" / "rewards.py", files / "my_rewards.py")
    for name, text in BROKEN.items():
        (files / name).write_text(text)
    site = root / "site"
    package = site / "looprl_demo_plugins"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        (EXAMPLES / "multi_turn" / "envs.py").read_text()
        + "\n\n"
        + (EXAMPLES / "single_turn" / "rewards.py").read_text().split('"""', 2)[2]
    )
    info = site / DIST_INFO
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: looprl-demo-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    (info / "top_level.txt").write_text("looprl_demo_plugins\n")
    return files, site


@pytest.fixture(scope="module")
def plugin_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    root = tmp_path_factory.mktemp("plugins")
    files, site = _plugin_dirs(root)
    rows = [json.loads(line) for line in (EXAMPLES / "multi_turn" / "train.jsonl").read_text().splitlines()]
    shutil.copy(EXAMPLES / "multi_turn" / "train.jsonl", root / "relay.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), root / "relay.parquet")
    dirs = (files, site, EXAMPLES / "single_turn")
    up_args = (*(arg for d in dirs for arg in ("--plugin-dir", str(d))), "--data-dir", str(root))
    with pytest.MonkeyPatch.context() as env:
        # The trainer keeps fewer exports of evaluated steps than the single-turn run evaluates.
        env.setenv("LOOPRL_TRAINER_KEEP_EVAL_EXPORTS", str(KEEP_EVAL_EXPORTS))
        with local_stack(root / "state", up_args=up_args) as stack:
            yield stack, root


def _relay_recipe(name: str, env: str, reward: str, dataset: Path) -> str:
    recipe = with_overrides(
        MULTI_TURN,
        run={"name": name, "steps": 30},
        environment={"name": env},
        dataset={"path": str(dataset)},
    )
    return recipe.replace("[dataset]", f'[reward]\nfunction = "{reward}"\n\n[dataset]')


def _rises(run: gateway_pb2.Run, margin: float) -> tuple[float, float]:
    rewards = [h.reward_mean for h in run.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + margin, f"{run.run_id}: reward {first:.3f} -> {last:.3f}"
    return first, last


def test_plugin_environment_and_reward_from_a_directory_train_from_jsonl(plugin_stack) -> None:
    stack, root = plugin_stack
    recipe = _relay_recipe("relay-jsonl", "my_envs.py:Relay", "my_rewards.py:score", root / "relay.jsonl")
    run = run_to_end(stack.stub, stack.metadata, recipe, "relay-jsonl", timeout=300)
    print("relay from JSONL, file plugins: reward {:.3f} -> {:.3f}".format(*_rises(run, 0.1)))
    assert run.dataset.rows == 200 and run.dataset.eval_rows == 16 and run.dataset.train_rows == 184
    assert [e.step for e in run.evaluations] == [0, 20, 30]
    # Evaluation episodes never train: every trained rollout is one of the steps' own.
    assert run.rollouts_trained == run.total_steps * 32


def test_plugin_environment_and_reward_of_an_installed_package_train_from_parquet(plugin_stack) -> None:
    stack, root = plugin_stack
    recipe = _relay_recipe("relay-parquet", "relay", "digit_score", root / "relay.parquet")
    run = run_to_end(stack.stub, stack.metadata, recipe, "relay-parquet", timeout=300)
    print("relay from parquet, entry points: reward {:.3f} -> {:.3f}".format(*_rises(run, 0.1)))
    assert run.dataset.rows == 200


def test_single_turn_example_evaluates_during_the_run_and_looprl_eval_reproduces_it(plugin_stack) -> None:
    stack, _ = plugin_stack
    recipe = with_overrides(SINGLE_TURN, run={"steps": 30}, eval={"every": 10})
    run = run_to_end(stack.stub, stack.metadata, recipe, "single-turn", timeout=300)
    print("single-turn example: reward {:.3f} -> {:.3f}".format(*_rises(run, 0.1)))
    assert [e.step for e in run.evaluations] == [0, 10, 20, 30]
    last = run.evaluations[-1]
    assert last.prompts == 32 and last.k == 4 and set(last.sources) == {"rev", "copy"}
    assert last.pass_at_k >= last.pass_at_1 - 1e-9 or last.greedy
    listing = stack.looprl("runs").stdout
    assert f"eval@30 pass@1 {last.pass_at_1:.3f}" in listing, listing
    # Any step the run evaluated: one whose export the trainer keeps (it keeps 20 and 30), and the
    # initial model, which the recipe rebuilds.
    for recorded in (run.evaluations[2], run.evaluations[0]):
        args = ("--step", str(recorded.step), "--report-dir", str(stack.state_dir / "r"))
        again = stack.looprl("eval", "single-turn", *args)
        assert again.returncode == 0, again.stdout + again.stderr
        at = f"evaluation of single-turn at step {recorded.step}:"
        line = next(x for x in again.stdout.splitlines() if x.startswith(at))
        assert f"pass@1 {recorded.pass_at_1:.4f}," in line, line
        assert f"recorded pass@1 {recorded.pass_at_1:.4f}" in line, line
        assert f"mean reward {recorded.mean_reward:.4f} over" in line, line
    pruned = stack.looprl("eval", "single-turn", "--step", "10", "--report-dir", str(stack.state_dir / "r"))
    assert pruned.returncode == 2 and "exported there: 20, 30;" in pruned.stderr, pruned.stderr
    summary = (stack.state_dir / "r").glob("*/summary.md")
    assert any("Held-out evaluation" in s.read_text() for s in summary)


def _refused(stack: Stack, recipe: str, run_id: str) -> grpc.RpcError:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.CreateRun(
            gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id=run_id), metadata=stack.metadata
        )
    assert time.monotonic() - started < FAIL_S
    with pytest.raises(grpc.RpcError) as missing:  # nothing was created
        stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    return err.value


@pytest.mark.parametrize(
    ("env", "reward", "config", "code", "expected"),
    [
        (
            "broken_import.py:Env",
            "my_rewards.py:score",
            "",
            "FAILED_PRECONDITION",
            [
                "'broken_import.py:Env' failed to import",
                "broken_import.py:3",
                "ModuleNotFoundError",
                "no_such_module",
            ],
        ),
        (
            "my_envs.py:Relay",
            "my_rewards.py:score",
            "format_weight = 'heavy'",
            "INVALID_ARGUMENT",
            ["reward.config.format_weight", "heavy"],
        ),
        (
            "my_envs.py:Relay",
            "bad_rewards.py:raises",
            "",
            "FAILED_PRECONDITION",
            ["'bad_rewards.py:raises' raised", "bad_rewards.py:5", "ZeroDivisionError"],
        ),
        (
            "my_envs.py:Relay",
            "bad_rewards.py:nan",
            "",
            "FAILED_PRECONDITION",
            ["'bad_rewards.py:nan'", "returned nan, not a finite number"],
        ),
        (
            "my_envs.py:Relay",
            "bad_rewards.py:text",
            "",
            "FAILED_PRECONDITION",
            ["'bad_rewards.py:text'", "returned 'good' (str), not a number"],
        ),
        (
            "os:system",
            "my_rewards.py:score",
            "",
            "FAILED_PRECONDITION",
            ["'os:system'", "neither in a plugin directory"],
        ),
    ],
    ids=["import-error", "bad-config", "reward-raises", "reward-nan", "reward-string", "not-a-plugin"],
)
def test_a_broken_plugin_is_refused_at_once_naming_it_and_the_cause(
    plugin_stack, env: str, reward: str, config: str, code: str, expected: list[str]
) -> None:
    stack, root = plugin_stack
    recipe = _relay_recipe("broken", env, reward, root / "relay.jsonl")
    if config:
        recipe = recipe.replace(f'function = "{reward}"', f'function = "{reward}"\nconfig = {{ {config} }}')
    error = _refused(stack, recipe, "broken")
    assert error.code().name == code, error.details()
    for text in expected:
        assert text in error.details(), error.details()


def test_a_bad_environment_config_is_refused_against_the_plugins_own_schema(plugin_stack) -> None:
    stack, root = plugin_stack
    recipe = _relay_recipe("broken", "my_envs.py:Relay", "my_rewards.py:score", root / "relay.jsonl")
    error = _refused(stack, recipe.replace("lone_digit_credit = 0.25", "lone_digit_credit = 2.0"), "broken")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "environment_config.lone_digit_credit" in error.details() and "1" in error.details()


def test_a_reward_that_raises_on_the_models_answers_fails_the_run_and_frees_it(plugin_stack) -> None:
    stack, root = plugin_stack
    recipe = _relay_recipe(
        "raises-later", "my_envs.py:Relay", "bad_rewards.py:raises_on_model_output", root / "relay.jsonl"
    )
    stack.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id="raises-later"), metadata=stack.metadata
    )
    started, running_at = time.monotonic(), None
    while time.monotonic() - started < 120:
        run = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id="raises-later"), metadata=stack.metadata).run
        if run.state == gateway_pb2.RUN_STATE_RUNNING and running_at is None:
            running_at = time.monotonic()
        if run.state == gateway_pb2.RUN_STATE_FAILED:
            break
        time.sleep(0.2)
    assert run.state == gateway_pb2.RUN_STATE_FAILED, run.error
    assert running_at is not None
    failed_after = time.monotonic() - running_at
    print(f"failed {time.monotonic() - started:.1f}s after CreateRun, {failed_after:.1f}s after it ran")
    # From the run's start: its replicas load and sample before the first score can fail it.
    assert failed_after < FAIL_S, run.error
    for text in ("'bad_rewards.py:raises_on_model_output' raised", "bad_rewards.py:18", "KeyError"):
        assert text in run.error, run.error
    assert run.rollouts_trained == 0
    # Nothing left running: the run's deployments go.
    router = inference_pb2_grpc.InferenceRouterServiceStub(stack.state.channel("inference-router"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        names = [d.name for d in router.ListDeployments(inference_pb2.ListDeploymentsRequest()).deployments]
        if not any(n.startswith("raises-later/") for n in names):
            break
        time.sleep(0.5)
    assert not any(n.startswith("raises-later/") for n in names), names
