"""Plugin environments in the environment-sandbox: LoadEnvironment loads one by import path, checks
its config against its own schema and tries a reset; one whose code raises during an episode stops
the run (PluginFailure, which the episode worker reports as fatal) instead of being retried forever;
and an evaluation task is refused by the episode queue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from looprl.common.v1 import common_pb2
from looprl.environment.v1 import environment_pb2 as pb
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner
from services.environment_sandbox.config import SandboxConfig
from services.environment_sandbox.environments import PluginFailure, set_plugin_dirs
from services.environment_sandbox.model_io import ModelTurn, OneAtATime
from services.environment_sandbox.run_dataset import DatasetCache
from services.environment_sandbox.sandbox import SandboxPool
from services.environment_sandbox.servicer import EnvironmentSandboxServicer
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.modeling.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[3]

FLAKY = """from services.environment_sandbox.environments import Environment, StepResult


class Flaky(Environment):
    description = "raises on its second turn"
    multi_turn = True

    @classmethod
    def generate(cls, rng, config):
        return {"prompt": "go"}

    def validate_task(self, task):
        pass

    async def _reset(self):
        return [{"role": "user", "content": self.task["prompt"]}]

    async def _step(self, action):
        if self.turns == 2:
            raise ValueError("state machine broke")
        return StepResult([{"role": "user", "content": "again"}], 0.0, False)


def helper():
    pass


class ResetFails(Flaky):
    async def _reset(self):
        return self.task["missing"]
"""


@pytest.fixture
def servicer(tmp_path: Path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    dirs = (tmp_path, ROOT / "examples" / "multi_turn")
    set_plugin_dirs(dirs)
    yield EnvironmentSandboxServicer(SandboxPool(SandboxConfig()), None, datasets=DatasetCache(dirs))
    set_plugin_dirs(())


def _request(env: str, config: dict | None = None, **kw) -> pb.LoadEnvironmentRequest:
    return pb.LoadEnvironmentRequest(
        environment=env, environment_config_json=json.dumps(config or {}), tokenizer="char", **kw
    )


async def test_load_environment_loads_a_plugin_and_its_dataset(servicer) -> None:
    dataset = json.dumps({"path": str(ROOT / "examples/multi_turn/train.jsonl"), "eval_size": 16, "seed": 1})
    reply = await servicer.LoadEnvironment(
        _request("envs.py:Relay", {"max_turns": 3}, dataset_json=dataset, max_prompt_tokens=100), None
    )
    assert reply.environment.multi_turn and reply.environment.plugin.endswith("examples/multi_turn/envs.py")
    assert (reply.dataset.rows, reply.dataset.train_rows, reply.dataset.eval_rows) == (200, 184, 16)
    assert json.loads(reply.first_task_json)["prompt"].isdigit() and reply.first_answer


async def test_load_environment_refuses_naming_the_field_file_and_line(servicer) -> None:
    with pytest.raises(InvalidArgument, match=r"environment_config.lone_digit_credit: .*1"):
        await servicer.LoadEnvironment(_request("envs.py:Relay", {"lone_digit_credit": 5}), None)
    with pytest.raises(
        FailedPrecondition, match=r"'flaky.py:ResetFails' failed its trial: .*flaky.py:30: KeyError"
    ):
        await servicer.LoadEnvironment(_request("flaky.py:ResetFails"), None)
    with pytest.raises(FailedPrecondition, match=r"'flaky.py:Nope': .*flaky.py has no attribute 'Nope'"):
        await servicer.LoadEnvironment(_request("flaky.py:Nope"), None)
    with pytest.raises(FailedPrecondition, match=r"is the function helper, not a subclass of"):
        await servicer.LoadEnvironment(_request("flaky.py:helper"), None)
    with pytest.raises(
        NotFound, match=r"environment.name: unknown environment 'sudoku': the environment-sandbox serves"
    ):
        await servicer.LoadEnvironment(_request("sudoku"), None)


class _Model:
    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version) -> ModelTurn:
        return ModelTurn([ord("a") % 100 + 1], [-0.1], "stop", 0)


async def test_an_environment_raising_mid_episode_stops_the_run(servicer) -> None:
    runner = EpisodeRunner(OneAtATime(_Model()), None, CharTokenizer())
    task = events_pb2.EpisodeTask(
        run_id="r",
        task_id="t",
        group_id="g",
        environment="flaky.py:Flaky",
        task_json=json.dumps({"prompt": "go"}),
        environment_config_json=json.dumps({"max_turns": 4}),
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    with pytest.raises(
        PluginFailure, match=r"'flaky.py:Flaky' raised: .*flaky.py:20: ValueError: state machine broke"
    ):
        await runner.run_all(task)


EXITS = """import sys

from flaky import Flaky


class ExitsMidEpisode(Flaky):
    async def _step(self, action):
        sys.exit(3)


class ExitsOnReset(Flaky):
    async def _reset(self):
        raise SystemExit(4)


class RefusesSevens(Flaky):
    async def _reset(self):
        if self.task["prompt"] == "7":
            raise ValueError("no sevens")
        return [{"role": "user", "content": self.task["prompt"]}]


def source_exits():
    sys.exit(5)
"""


async def test_plugin_code_that_exits_fails_its_run_not_the_service(servicer, tmp_path: Path) -> None:
    (tmp_path / "exits.py").write_text(EXITS)
    runner = EpisodeRunner(OneAtATime(_Model()), None, CharTokenizer())
    task = events_pb2.EpisodeTask(
        run_id="r",
        task_id="t",
        group_id="g",
        environment="exits.py:ExitsMidEpisode",
        task_json=json.dumps({"prompt": "go"}),
        environment_config_json=json.dumps({"max_turns": 4}),
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    with pytest.raises(
        PluginFailure, match=r"'exits.py:ExitsMidEpisode' raised: .*exits.py:8: SystemExit: 3"
    ):
        await runner.run_all(task)
    with pytest.raises(
        FailedPrecondition, match=r"'exits.py:ExitsOnReset' failed its trial: .*SystemExit: 4"
    ):
        await servicer.LoadEnvironment(_request("exits.py:ExitsOnReset"), None)
    source = json.dumps({"source": "exits.py:source_exits", "seed": 1})
    with pytest.raises(FailedPrecondition, match=r"dataset.source: .*exits.py:24: SystemExit: 5"):
        await servicer.LoadEnvironment(_request("envs.py:Relay", dataset_json=source), None)


async def test_a_plugin_environment_refusing_a_dataset_row_is_named(servicer, tmp_path: Path) -> None:
    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in "1237"))
    dataset = json.dumps({"path": str(tmp_path / "rows.jsonl"), "seed": 1})
    with pytest.raises(
        FailedPrecondition, match=r"'exits.py:RefusesSevens' .*exits.py:19: ValueError: no sevens"
    ):
        await servicer.LoadEnvironment(_request("exits.py:RefusesSevens", dataset_json=dataset), None)
