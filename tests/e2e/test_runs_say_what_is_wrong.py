"""Runs that say what is wrong, on a real stack, seen as a user sees them (GetRun, `looprl run`,
`looprl runs`): a run whose prerequisites are missing is refused at CreateRun with the reason and
never exists; a run whose every episode fails while its services are healthy reads STALLED within
its run.stall_seconds, naming the environment-sandbox and the router's error."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from looprl.gateway.v1 import gateway_pb2
from tests.support.runs import with_overrides
from tests.support.stack import DEFAULT_RECIPE, local_stack

pytestmark = pytest.mark.slow

# CreateRun's checks ask the services over gRPC: an answer well within this, never a hang.
REFUSAL_S = 10.0


def _model_dir(tmp_path: Path, vocab_size: int) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab_size}))
    return str(model)


def _edit(recipe: str, old: str, new: str) -> str:
    assert recipe.count(old) == 1, old
    return recipe.replace(old, new)


MISSING = [
    (
        with_overrides(DEFAULT_RECIPE, environment={"name": "no-such-env"}),
        "FAILED_PRECONDITION",
        "environment.name: unknown environment 'no-such-env': the environment-sandbox serves ",
    ),
    (
        with_overrides(DEFAULT_RECIPE, environment={"reward": "no-such-reward"}),
        "FAILED_PRECONDITION",
        "environment.reward: unknown reward 'no-such-reward': the reward service serves ",
    ),
    (
        _edit(DEFAULT_RECIPE, 'preset = "tiny-qwen2"', "path = '{model}'"),
        "FAILED_PRECONDITION",
        "model.tokenizer: vocabulary mismatch: the model ({model}) has vocab_size 1024, the tokenizer 'char' "
        "only 101 ids",
    ),
    (
        _edit(DEFAULT_RECIPE, "lr = 3e-3", "lr = 3e-3\nweight_decay = nan"),
        "INVALID_ARGUMENT",
        "optimizer.weight_decay: must be a finite number, got nan",
    ),
    (
        _edit(DEFAULT_RECIPE, 'ops = ["rev"] }', 'ops = ["rev"], scale = inf }'),
        "INVALID_ARGUMENT",
        "environment.config.scale: must be a finite number, got inf",
    ),
]


@pytest.mark.parametrize(("recipe", "code", "reason"), MISSING, ids=[m[2].split(":")[0] for m in MISSING])
def test_a_run_missing_a_prerequisite_is_refused_naming_it_and_never_exists(
    stack, tmp_path: Path, recipe: str, code: str, reason: str
) -> None:
    model = _model_dir(tmp_path, vocab_size=1024)
    recipe, reason = recipe.replace("{model}", model), reason.replace("{model}", model)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.CreateRun(
            gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id="refused"), metadata=stack.metadata
        )
    assert time.monotonic() - started < REFUSAL_S
    assert err.value.code().name == code
    assert reason in err.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id="refused"), metadata=stack.metadata)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stack.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=stack.metadata).runs
    if "unknown environment" in reason:  # as `looprl run` shows it
        (tmp_path / "recipe.toml").write_text(recipe)
        cli = stack.looprl("run", str(tmp_path / "recipe.toml"))
        assert cli.returncode == 2
        assert "FAILED_PRECONDITION: environment.name: unknown environment 'no-such-env'" in cli.stderr
        assert "digits" in cli.stderr  # what the environment-sandbox does serve
        assert stack.looprl("runs").stdout.strip() == ""


STALL_S = 5.0
# Every deployment holds at most 8 tokens: the router refuses every prompt, so every episode fails
# while every service stays healthy.
TOO_SHORT = _edit(
    _edit(
        with_overrides(DEFAULT_RECIPE, run={"steps": 3}),
        "\nmax_staleness = 0\n",
        f"\nmax_staleness = 0\nstall_seconds = {STALL_S}\n",
    ),
    "max_model_len = 128",
    "max_model_len = 8",
)


def test_a_run_whose_episodes_all_fail_is_stalled_naming_the_component_and_error(tmp_path: Path) -> None:
    with local_stack(tmp_path, TOO_SHORT) as stack:
        run_id = stack.stub.CreateRun(
            gateway_pb2.CreateRunRequest(recipe_toml=TOO_SHORT, run_id="too-short"), metadata=stack.metadata
        ).run.run_id
        started = time.monotonic()
        while True:
            run = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run
            if run.state == gateway_pb2.RUN_STATE_STALLED and "environment-sandbox" in run.stalled_reason:
                break
            assert time.monotonic() - started < STALL_S + 30, f"not stalled: {run}"
            time.sleep(0.5)
        took = time.monotonic() - started
        print(f"stalled {took:.1f}s after CreateRun (stall_seconds {STALL_S}): {run.stalled_reason}")
        assert run.step == 0
        assert "max_model_len" in run.stalled_reason, run.stalled_reason
        assert run.last_error.component == "environment-sandbox" and run.last_error.occurrences >= 1
        # The initial weights (v0) reaching the deployments is progress: on a loaded host that can
        # land after the first stall mark and clear it, and the run stalls again STALL_S later.
        while True:
            listed = stack.looprl("runs")
            assert listed.returncode == 0
            line = next(line for line in listed.stdout.splitlines() if line.startswith(run_id))
            if "[  stalled]" in line:
                break
            assert time.monotonic() - started < 2 * STALL_S + 30, f"not stalled: {line}"
            time.sleep(0.5)
        assert "stalled: no progress at step 0/3" in line
        assert "environment-sandbox reported" in line and "max_model_len" in line
        # `looprl watch` follows a stalled run (it has not ended) and shows why on every line.
        try:
            watched = stack.looprl("watch", run_id, timeout=10).stdout
        except subprocess.TimeoutExpired as exc:
            watched = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        assert "[  stalled] step   0/3" in watched and "environment-sandbox reported" in watched
