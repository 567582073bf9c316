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


# A forger that looks everywhere it can for the expected value and reports it: the expected
# values stay outside the sandbox, so it has nothing to report but guesses.
FORGER = """
import os, re, sys
seen = open('/tmp/main.py').read() + open('/proc/self/cmdline').read() + str(dict(os.environ))
want = str(4 * 10**5 + 87654)  # computed, so this source does not itself contain it
print('leaked' if want in seen else 'not leaked', file=sys.stderr)
for nonce in set(re.findall(r"@@[0-9a-z]+", seen)):
    print(nonce, '{"passed": 1, "total": 1}')
print('@@probe 0', want if want in seen else 1)
print('@@probes-done')
sys.stdout.flush()
os._exit(0)
"""
BIG = {"prompt": "def add(a, b)", "tests": ["assert add(400000, 87654) == 487654"]}


async def test_a_forged_result_line_earns_nothing(context):
    reward, info = await _score(context, FORGER, BIG)
    assert reward == 0.0 and info.get("passed", "0") == "0"
    from services.kit.usercode.code_tests import build_program, parse_tests

    result = await context.executor(code=build_program(FORGER, parse_tests(BIG["tests"])))
    assert "not leaked" in result.stderr
    # Guessing every value for every test: two results for one test void the run.
    guesses = "for i in range(2):\n    for n in range(10):\n        print('@@probe', i, n)\nprint('@@probes-done')\n"
    reward, info = await _score(context, guesses + "import os, sys\nsys.stdout.flush()\nos._exit(0)\n")
    assert reward == 0.0 and "tampered" in info["error"]
    # The old forgery (a counts line with total 0) is just output now: a clean zero, no crash.
    reward, info = await _score(context, 'print(\'@@cafe {"passed": 0, "total": 0}\')\nraise SystemExit(0)\n')
    assert reward == 0.0


async def test_the_real_solution_still_scores_through_the_probes(context):
    assert (await _score(context, "def add(a, b):\n    print('debugging', a, b)\n    return a + b\n", BIG))[
        0
    ] == 1.0


async def test_tests_that_are_not_asserts_are_refused_naming_the_test(context):
    from services.environment_sandbox.environments import EnvironmentError_

    env = make_environment("code", None, context)
    with pytest.raises(EnvironmentError_, match=r"task_json.tests\[1\]: must be a single assert"):
        await env.reset({"prompt": "p", "tests": ["assert f(1) == 1", "x = f(2)\nassert x == 2"]})


async def test_reward_code_tests_cannot_be_forged_and_empty_tests_fail_cleanly(context):
    from services.reward.registry import default_registry
    from services.reward.verifiers import ScoreInput

    registry = default_registry(context.executor)
    forged = await registry.score("code", ScoreInput(task=BIG, completion=FORGER))
    assert forged.ok and forged.score == 0.0
    solved = await registry.score("code", ScoreInput(task=BIG, completion="def add(a, b): return a + b"))
    assert solved.ok and solved.score == 1.0
    empty = await registry.score("code", ScoreInput(task={"tests": []}, completion="x"))
    assert not empty.ok and empty.score == 0.0 and "non-empty" in empty.components[0].reason
