"""code: the model writes a Python function; the environment runs it against tests in the
sandbox; the reward is the fraction of tests that pass.

Each test is an assertion. Only its expression goes into the sandbox (see services/kit/usercode/code_tests):
the sandbox reports the values the solution computes, and this process compares them with the
expected values, which the sandboxed code never sees, so printing a fake result cannot earn reward.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)
from services.kit.usercode.code_tests import CodeTestError, build_program, parse_tests, score_output

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole text when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


PROBLEMS: list[dict[str, Any]] = [
    {"entry": "add", "sig": "add(a, b)", "desc": "returns a + b", "fn": lambda a, b: a + b, "arity": 2},
    {"entry": "mul", "sig": "mul(a, b)", "desc": "returns a * b", "fn": lambda a, b: a * b, "arity": 2},
    {"entry": "biggest", "sig": "biggest(a, b)", "desc": "returns the larger", "fn": max, "arity": 2},
    {"entry": "square", "sig": "square(x)", "desc": "returns x * x", "fn": lambda x: x * x, "arity": 1},
    {
        "entry": "is_even",
        "sig": "is_even(x)",
        "desc": "True if x is even",
        "fn": lambda x: x % 2 == 0,
        "arity": 1,
    },
]


@dataclass
class CodeConfig(EnvConfig):
    """Write a Python function that passes tests run in the sandbox."""

    max_action_chars: int = Field(8192, ge=1)
    """Longest program the environment runs."""
    num_tests: int = Field(4, ge=1, le=64)
    """Tests generated per task."""
    timeout_s: float = Field(2.0, gt=0.0, le=60.0)
    """Wall-clock limit of one run of the tests."""


@register
class CodeEnv(Environment):
    name = "code"
    description = "Write a Python function; it runs against tests in the sandbox; reward = pass rate."
    default_reward = "code"
    Config = CodeConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        assert isinstance(config, CodeConfig)
        problem = rng.choice(PROBLEMS)
        tests = []
        for _ in range(config.num_tests):
            args = [rng.randint(-20, 20) for _ in range(problem["arity"])]
            call = f"{problem['entry']}({', '.join(map(str, args))})"
            tests.append(f"assert {call} == {problem['fn'](*args)!r}")
        return {
            "prompt": f"def {problem['sig']}: {problem['desc']}",
            "entry_point": problem["entry"],
            "tests": tests,
        }

    def validate_task(self, task: dict[str, Any]) -> None:
        if not isinstance(task.get("prompt"), str):
            raise EnvironmentError_("task_json.prompt: must be a string")
        tests = task.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise EnvironmentError_("task_json.tests: must be a non-empty list of strings")
        try:
            parse_tests(tests, "task_json.tests")
        except CodeTestError as exc:
            raise EnvironmentError_(str(exc)) from None

    async def _reset(self) -> list[Message]:
        return [{"role": "user", "content": self.task["prompt"]}]

    async def _step(self, action: str) -> StepResult:
        if self.context.executor is None:
            raise EnvironmentError_("environment: 'code' needs a sandbox and none is configured")
        checks = parse_tests(self.task["tests"], "task_json.tests")
        program = build_program(extract_code(action), checks)
        timeout = float(getattr(self.config, "timeout_s", 2.0))
        await self.context.acquire("sandbox")  # a no-op unless a limit names the sandbox
        result = await self.context.executor(code=program, timeout_s=timeout)
        outcome = score_output(result.stdout, checks)
        if outcome.error:
            reason = result.killed_reason or f"exit {result.exit_code}"
            return StepResult([], 0.0, True, {"error": f"{outcome.error}: {reason}"})
        info = {"passed": str(outcome.passed), "total": str(outcome.total)}
        return StepResult([], outcome.passed / outcome.total, True, info)
