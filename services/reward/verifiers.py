"""Rule verifiers: exact match, numeric/math equivalence, format checks, the digits scorer,
code tests pass rate (through the sandbox), and a pass-through of the environment's own reward.

A verifier is an async callable (ScoreInput) -> float in [0, 1]. It raises VerifierError when it
cannot score (missing reference, sandbox down): the composition turns that into an explicit
failed component with the reason, never a silent 0.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from services.kit.usercode.code_tests import CodeTestError, build_program, parse_tests, score_output


class VerifierError(RuntimeError):
    """The verifier could not produce a score; the message is the reason reported."""


@dataclass
class ScoreInput:
    task: dict[str, Any]
    completion: str
    transcript: str = ""
    environment_reward: float | None = None
    rollout_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


Verifier = Callable[[ScoreInput], Awaitable[float]]


def reference(task: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in task:
            return task[key]
    raise VerifierError(f"task_json: has no reference answer (looked for {', '.join(keys)})")


def _normalize(text: str) -> str:
    return " ".join(text.strip().split()).lower()


async def exact_match(inp: ScoreInput) -> float:
    """1 when the completion equals the reference answer, ignoring case and surrounding space."""
    answer = reference(inp.task, "answer", "target")
    return 1.0 if _normalize(inp.completion) == _normalize(str(answer)) else 0.0


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def parse_number(text: str) -> Fraction | float:
    """A number from '3/4', '0.75', '1e3', '2^3', '-(1+2)*3', '$1,000', '50%' (arithmetic only)."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("^", "**")
    percent = cleaned.endswith("%")
    if percent:
        cleaned = cleaned[:-1]
    try:
        tree = ast.parse(cleaned, mode="eval")
    except SyntaxError:
        raise VerifierError(f"not a number: {text[:40]!r}") from None

    def ev(node: ast.AST) -> Fraction | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return Fraction(node.value) if isinstance(node.value, int) else Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise VerifierError("exponent too large")
            try:
                return _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise VerifierError("division by zero") from None
        raise VerifierError(f"not a number: {text[:40]!r}")

    value = ev(tree)
    return value / 100 if percent else value


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_answer(text: str) -> str:
    """The answer part of a completion: \\boxed{...}, text after '####' or 'answer:', or the last number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    for marker in ("####", "answer:", "Answer:"):
        if marker in text:
            return text.rsplit(marker, 1)[1].strip()
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else text


async def numeric_equivalence(inp: ScoreInput) -> float:
    """1 when the completion's final answer equals the reference as a number (3/4 == 0.75 == 75%)."""
    expected = parse_number(str(reference(inp.task, "answer", "target")))
    try:
        got = parse_number(final_answer(inp.completion))
    except VerifierError:
        return 0.0  # an unparsable answer is a wrong answer, not a verifier failure
    return 1.0 if math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9) else 0.0


async def digits_format(inp: ScoreInput) -> float:
    """1 when the completion is only digits, of the reference's length."""
    answer = inp.completion.strip()
    target = _digits_target(inp.task)
    return 1.0 if answer.isdigit() and len(answer) == len(target) else 0.0


def _digits_target(task: dict[str, Any]) -> str:
    if "answer" in task:
        return str(task["answer"])
    digits = reference(task, "digits")
    return digits[::-1] if task.get("op", "rev") == "rev" else digits


async def digits_partial_credit(inp: ScoreInput) -> float:
    """0.9 * fraction of digits right in position + 0.1 for the right length (as the environment)."""
    target = _digits_target(inp.task)
    answer = inp.completion.strip()
    if not target:
        raise VerifierError("task_json.answer: empty")
    correct = sum(1 for a, t in zip(answer, target, strict=False) if a == t)
    return 0.9 * correct / len(target) + (0.1 if len(answer) == len(target) else 0.0)


async def environment_reward(inp: ScoreInput) -> float:
    """The environment's own reward for the episode (guess: found in few turns)."""
    if inp.environment_reward is None:
        raise VerifierError("environment_reward: not given; the environment reported no reward")
    return float(inp.environment_reward)


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

CodeExecutor = Callable[..., Awaitable[Any]]


def make_code_tests(executor: CodeExecutor | None, timeout_s: float = 5.0) -> Verifier:
    """Pass rate of the task's tests run against the completion's code in the sandbox."""

    async def code_tests(inp: ScoreInput) -> float:
        tests = reference(inp.task, "tests")
        if not isinstance(tests, list) or not tests:
            raise VerifierError("task_json.tests: must be a non-empty list")
        if executor is None:
            raise VerifierError("no sandbox configured for code tests (set LOOPRL_REWARD_SANDBOX_ADDRESS)")
        blocks = _FENCE.findall(inp.completion)
        solution = blocks[-1] if blocks else inp.completion
        try:
            checks = parse_tests(tests, "task_json.tests")
        except CodeTestError as exc:
            raise VerifierError(str(exc)) from None
        result = await executor(code=build_program(solution, checks), timeout_s=timeout_s)
        outcome = score_output(result.stdout, checks)
        # The sandbox itself failing raises (a failed component). A run that gave no verdict was
        # stopped by the solution (exit, tampering) or by the sandbox's limits: the solution fails.
        return 0.0 if outcome.error else outcome.passed / outcome.total

    return code_tests
