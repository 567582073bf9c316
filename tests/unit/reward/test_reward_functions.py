"""Reward functions from the user's code: loaded by reference or entry point only from where the
operator allows, their settings checked against their own parameters, and every way they can fail
(an import error, raising, NaN, a string) named with the plugin's file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from looprl.reward.v1 import reward_pb2
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.kit.usercode import plugins
from services.reward.functions import BadRewardConfig, load_function
from services.reward.registry import default_registry
from services.reward.servicer import RewardServicer
from services.reward.verifiers import ScoreInput

REWARDS = """import math


def score(prompt, completion, answer, *, bonus: float = 0.0, **metadata):
    return float(completion == answer) + bonus + metadata.get("level", 0) / 10


def parts(prompt, completion, answer, transcript=""):
    return {"score": 0.5, "format": 1.0}


def boom(prompt, completion, answer, **metadata):
    raise RuntimeError("table missing")


def nan(prompt, completion, answer):
    return math.nan


def words(prompt, completion, answer):
    return "great"


def two(prompt, completion):
    return 1.0


def strict(prompt, completion, answer, *, table: str):
    return 1.0 if table else 0.0


def verdict(prompt, completion, answer):
    return completion == answer
"""


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "broken.py").write_text("x = 1\nimport not_a_module\n")
    return tmp_path


def _input(answer: str = "42", completion: str = "42", **task) -> ScoreInput:
    return ScoreInput({"prompt": "q", "answer": answer, "metadata": task}, completion)


async def test_a_function_scores_with_its_metadata_and_settings(plugin_dir: Path) -> None:
    fn = load_function("rewards.py:score", json.dumps({"bonus": 0.25}), (plugin_dir,))
    assert await fn(_input(level=3), 5.0) == (pytest.approx(1.55), {})
    parts = load_function("rewards.py:parts", "", (plugin_dir,))
    assert await parts(_input(), 5.0) == (0.5, {"format": 1.0})
    verdict = load_function("rewards.py:verdict", "", (plugin_dir,))  # a bool is 0 or 1
    assert await verdict(_input(), 5.0) == (1.0, {})


def test_settings_are_checked_against_the_functions_parameters(plugin_dir: Path) -> None:
    with pytest.raises(BadRewardConfig, match=r"reward.config.bonus: .*valid number"):
        load_function("rewards.py:score", json.dumps({"bonus": "lots"}), (plugin_dir,))
    with pytest.raises(
        BadRewardConfig,
        match=r"reward.config.bonsu: the function has no such parameter \(its settings: bonus\)",
    ):
        load_function("rewards.py:score", json.dumps({"bonsu": 1}), (plugin_dir,))
    with pytest.raises(BadRewardConfig, match=r"reward.config.table: required by .*rewards.py:28"):
        load_function("rewards.py:strict", "", (plugin_dir,))
    assert load_function("rewards.py:strict", '{"table": "t"}', (plugin_dir,)).config == {"table": "t"}
    with pytest.raises(plugins.PluginError, match=r"takes \(prompt, completion\); a reward is called as"):
        load_function("rewards.py:two", "", (plugin_dir,))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("boom", r"'rewards.py:boom' raised: .*rewards.py:13: RuntimeError: table missing"),
        ("nan", r"'rewards.py:nan' \(.*rewards.py:16\) returned nan, not a finite number"),
        ("words", r"'rewards.py:words' \(.*rewards.py:20\) returned 'great' \(str\), not a number"),
    ],
)
async def test_a_failing_function_is_a_plugin_error_naming_file_and_line(
    plugin_dir: Path, name: str, message: str
) -> None:
    fn = load_function(f"rewards.py:{name}", "", (plugin_dir,))
    with pytest.raises(plugins.PluginError, match=message):
        await fn(_input(), 5.0)


def test_only_code_the_operator_placed_loads(plugin_dir: Path, tmp_path_factory) -> None:
    with pytest.raises(
        plugins.PluginError, match=r"'broken.py:x' failed to import: .*broken.py:2: ModuleNotFoundError"
    ):
        load_function("broken.py:x", "", (plugin_dir,))
    with pytest.raises(plugins.PluginError, match=r"neither in a plugin directory"):
        load_function("os:system", "", (plugin_dir,))
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "other.py").write_text("def score(p, c, a):\n    return 1.0\n")
    with pytest.raises(plugins.PluginError, match=r"no file .* in the plugin directories"):
        load_function(f"{elsewhere / 'other.py'}:score", "", (plugin_dir,))
    with pytest.raises(plugins.PluginError, match=r"no entry point of that name in looprl.rewards"):
        load_function("no_such_reward", "", (plugin_dir,))


def test_an_entry_point_of_an_installed_distribution_loads(tmp_path: Path) -> None:
    (tmp_path / "acme_rewards.py").write_text(
        "def exact(prompt, completion, answer):\n    return float(completion == answer)\n"
    )
    info = tmp_path / "acme_rewards-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rewards\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[looprl.rewards]\nacme_exact = acme_rewards:exact\n")
    (info / "top_level.txt").write_text("acme_rewards\n")
    fn = load_function("acme_exact", "", (tmp_path,))
    assert fn.loaded.origin == "entry point acme_exact = acme_rewards:exact (acme-rewards 1.0)"
    # Its module by import path too: the distribution opted in by declaring a looprl entry point.
    assert load_function("acme_rewards:exact", "", (tmp_path,)).fn("", "a", "a") == 1.0


async def test_load_reward_scores_the_trials_and_refuses_a_broken_plugin(plugin_dir: Path) -> None:
    servicer = RewardServicer(default_registry(plugin_dirs=(plugin_dir,)))
    trial = reward_pb2.ScoreRequest(
        reward="rewards.py:score", task_json=json.dumps({"answer": "7"}), completion="7"
    )
    reply = await servicer.LoadReward(
        reward_pb2.LoadRewardRequest(reward="rewards.py:score", trials=[trial]), None
    )
    assert reply.reward.kind == "plugin" and reply.reward.plugin.endswith("rewards.py")
    assert reply.trials[0].score == 1.0
    with pytest.raises(FailedPrecondition, match=r"reward.function: plugin 'rewards.py:nan' .* returned nan"):
        await servicer.LoadReward(reward_pb2.LoadRewardRequest(reward="rewards.py:nan", trials=[trial]), None)
    with pytest.raises(InvalidArgument, match=r"reward.config.bonus"):
        await servicer.LoadReward(
            reward_pb2.LoadRewardRequest(reward="rewards.py:score", config_json='{"bonus": "x"}'), None
        )
    with pytest.raises(NotFound, match=r"unknown reward 'nope': the reward service serves "):
        await servicer.LoadReward(reward_pb2.LoadRewardRequest(reward="nope"), None)


async def test_a_score_of_a_broken_plugin_says_so_instead_of_a_silent_zero(plugin_dir: Path) -> None:
    servicer = RewardServicer(default_registry(plugin_dirs=(plugin_dir,)))
    reply = await servicer.Score(
        reward_pb2.ScoreRequest(reward="rewards.py:boom", task_json="{}", completion="x"), None
    )
    assert not reply.ok and "RuntimeError: table missing" in reply.plugin_error
    with pytest.raises(InvalidArgument, match=r"reward_config_json: only a plugin reward takes settings"):
        await servicer.Score(
            reward_pb2.ScoreRequest(reward="digits", reward_config_json="{}", completion="1"), None
        )


EXITS = """import sys


def exits(prompt, completion, answer):
    sys.exit(3)


async def exits_async(prompt, completion, answer):
    raise SystemExit(4)


class Odd(BaseException):
    pass


def odd(prompt, completion, answer):
    raise Odd("not an Exception")
"""


@pytest.mark.parametrize(
    ("name", "cause"),
    [("exits", "SystemExit: 3"), ("exits_async", "SystemExit: 4"), ("odd", "Odd: not an Exception")],
)
async def test_a_function_that_exits_is_a_plugin_error_not_the_services_exit(
    tmp_path: Path, name: str, cause: str
) -> None:
    (tmp_path / "exits.py").write_text(EXITS)
    servicer = RewardServicer(default_registry(plugin_dirs=(tmp_path,)))
    reply = await servicer.Score(
        reward_pb2.ScoreRequest(reward=f"exits.py:{name}", task_json="{}", completion="x"), None
    )
    assert not reply.ok and "exits.py:" in reply.plugin_error and cause in reply.plugin_error


HANGS = """import threading

RELEASE = threading.Event()


def hangs(prompt, completion, answer):
    RELEASE.wait(60)
    return 0.0


def quick(prompt, completion, answer):
    return 1.0
"""


async def test_a_function_that_hangs_times_out_its_own_calls_and_no_other_plugins(tmp_path: Path) -> None:
    """A reward stuck on some answers (a catastrophic regex) keeps its calls' threads: it must not
    take the threads another run's plugin scores with, which would then time out and fail that run."""
    import asyncio

    (tmp_path / "slow.py").write_text(HANGS)
    registry = default_registry(timeout_s=0.5, plugin_dirs=(tmp_path,))
    servicer = RewardServicer(registry)

    def score(name: str) -> reward_pb2.ScoreRequest:
        return reward_pb2.ScoreRequest(reward=f"slow.py:{name}", task_json="{}", completion="x")

    try:
        # More hung calls than any thread pool asyncio.to_thread would use has threads.
        hung = await asyncio.gather(*(servicer.Score(score("hangs"), None) for _ in range(40)))
        assert all("did not return within 0.5s" in r.plugin_error for r in hung)
        reply = await servicer.Score(score("quick"), None)
        assert reply.ok and reply.score == 1.0, reply.plugin_error
    finally:
        registry.plugin("slow.py:hangs").fn.__globals__["RELEASE"].set()


async def test_a_reward_first_scored_here_is_imported_off_the_event_loop(tmp_path: Path) -> None:
    """A reward service replica that did not answer the run's LoadReward imports the plugin at its
    first score: a slow import must not stop every other score of this process meanwhile."""
    (tmp_path / "where.py").write_text(
        "import threading\n\nON_LOOP = threading.current_thread() is threading.main_thread()\n\n\n"
        "def score(prompt, completion, answer):\n    return float(ON_LOOP)\n"
    )
    servicer = RewardServicer(default_registry(plugin_dirs=(tmp_path,)))
    reply = await servicer.Score(
        reward_pb2.ScoreRequest(reward="where.py:score", task_json="{}", completion="x"), None
    )
    assert reply.ok and reply.score == 0.0, "the plugin was imported on the event loop's thread"
