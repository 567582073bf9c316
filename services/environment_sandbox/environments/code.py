"""code: the model writes a Python function; the environment runs it against tests in the
sandbox; the reward is the fraction of tests that pass.

Each test is an assertion run in its own try block by a small harness, so one failing or crashing
test does not hide the others; the harness prints a marker line with the counts that the model's
own prints cannot fake without knowing the per-run nonce.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from dataclasses import dataclass
from typing import Any

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole text when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def build_harness(solution: str, tests: list[str], nonce: str) -> str:
    return (
        "import json as _json\n"
        f"_tests = {json.dumps(tests)}\n"
        "_passed = 0\n"
        "_ns = {'__name__': 'solution'}\n"
        "try:\n"
        f"    exec(compile({solution!r}, 'solution.py', 'exec'), _ns)\n"
        "    _loaded = True\n"
        "except BaseException as _exc:\n"
        "    _loaded = False\n"
        "    print('load error:', type(_exc).__name__, _exc)\n"
        "for _t in _tests if _loaded else []:\n"
        "    try:\n"
        "        exec(_t, dict(_ns))\n"
        "        _passed += 1\n"
        "    except BaseException as _exc:\n"
        "        pass\n"
        f"print({nonce!r}, _json.dumps({{'passed': _passed, 'total': len(_tests)}}), flush=True)\n"
    )


def parse_harness(stdout: str, nonce: str) -> tuple[int, int] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            data = json.loads(line[len(nonce) + 1 :])
            return int(data["passed"]), int(data["total"])
    return None


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
    max_action_chars: int = 8192
    num_tests: int = 4
    timeout_s: float = 2.0


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

    async def _reset(self) -> list[Message]:
        return [{"role": "user", "content": self.task["prompt"]}]

    async def _step(self, action: str) -> StepResult:
        if self.context.executor is None:
            raise EnvironmentError_("environment: 'code' needs a sandbox and none is configured")
        nonce = "@@" + secrets.token_hex(8)
        harness = build_harness(extract_code(action), self.task["tests"], nonce)
        timeout = float(getattr(self.config, "timeout_s", 2.0))
        await self.context.acquire("sandbox")  # a no-op unless a limit names the sandbox
        result = await self.context.executor(code=harness, timeout_s=timeout)
        counts = parse_harness(result.stdout, nonce)
        if counts is None:
            reason = result.killed_reason or f"exit {result.exit_code}"
            return StepResult([], 0.0, True, {"error": f"tests did not finish: {reason}"})
        passed, total = counts
        return StepResult([], passed / total, True, {"passed": str(passed), "total": str(total)})
