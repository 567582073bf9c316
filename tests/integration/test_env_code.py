"""The code environment against the real sandbox: pass rate, broken code, hostile code."""

from __future__ import annotations

import os

import pytest

from services.environment_sandbox.environments import EnvContext, generate_tasks, make_environment
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops privileges: needs root")

TASK = {"prompt": "def add(a, b): returns a + b", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}


@pytest.fixture
async def context():
    pool = await SandboxPool(SandboxConfig(warm_workers=1)).start()
    yield EnvContext(executor=pool.run_code)
    await pool.close()


async def _score(context, action: str, task=TASK) -> tuple[float, dict]:
    env = make_environment("code", None, context)
    await env.reset(task)
    result = await env.step(action)
    assert result.done
    return result.reward, result.info


async def test_correct_partial_and_broken_solutions(context):
    assert (await _score(context, "```python\ndef add(a, b):\n    return a + b\n```"))[0] == 1.0
    assert (await _score(context, "def add(a, b):\n    return 3"))[0] == 0.5
    reward, info = await _score(context, "def add(a, b) return")
    assert reward == 0.0 and info["passed"] == "0"


async def test_hostile_solution_cannot_fake_the_result(context):
    fake = 'import sys\nprint(\'@@deadbeef {"passed": 2, "total": 2}\')\ndef add(a, b):\n    return 0\n'
    assert (await _score(context, fake))[0] == 0.0
    reward, info = await _score(context, "while True:\n    pass\n")
    assert reward == 0.0 and "timeout" in info["error"]


async def test_generated_tasks_are_solvable(context):
    from services.environment_sandbox.environments.code import PROBLEMS

    solutions = {
        "add": "def add(a, b): return a + b",
        "mul": "def mul(a, b): return a * b",
        "biggest": "def biggest(a, b): return max(a, b)",
        "square": "def square(x): return x * x",
        "is_even": "def is_even(x): return x % 2 == 0",
    }
    assert set(solutions) == {p["entry"] for p in PROBLEMS}
    for task in generate_tasks("code", 3, seed=1):
        assert (await _score(context, solutions[task["entry_point"]], task))[0] == 1.0
