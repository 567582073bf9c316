"""The typed seams, checked: mypy (pinned in the dev extra, configured in pyproject.toml) finds
nothing in the shared packages, the Protocols and ABCs the services implement and their
implementations (`make check` runs the same), and it does fail on an implementation that breaks its
Protocol, whether it names the Protocol or is only handed where one is expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_typed_seams_check_clean():
    done = mypy()
    assert done.returncode == 0, done.stdout + done.stderr


MISTYPED = '''
from looprl.common.v1 import common_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner
from services.environment_sandbox.model_io import Generator, ModelTurn, Score
from services.modeling.tokenizer import CharTokenizer


class ListsOfText(Generator):
    """Names the Protocol, and answers generate_n with text instead of model turns."""

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> ModelTurn:
        raise NotImplementedError

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        n: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> list[str]:
        return []


class OneTurnOnly:
    """Names no Protocol and has no generate_n: handed to the loop as its Generator."""

    async def __call__(
        self, prompt_ids: list[int], sampling: common_pb2.SamplingParams, session_id: str, min_weight_version: int, /
    ) -> ModelTurn:
        raise NotImplementedError


async def score_without_rollout_id(reward: str, task_json: str, completion: str, transcript: str) -> Score:
    return Score(0.0)


EpisodeRunner(OneTurnOnly(), score_without_rollout_id, CharTokenizer())
'''


def test_a_mistyped_protocol_implementation_fails_the_check(tmp_path):
    module = tmp_path / "mistyped.py"
    module.write_text(MISTYPED)
    done = mypy(str(module))
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert any('"generate_n" incompatible with return type' in e and "Generator" in e for e in errors), errors
    assert any('Argument 1 to "EpisodeRunner"' in e and "OneTurnOnly" in e for e in errors), errors
    assert any('Argument 2 to "EpisodeRunner"' in e for e in errors), errors
    assert len(errors) == 3, errors
