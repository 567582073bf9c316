"""Code tests whose verdict the tested code cannot forge.

A test is one `assert` statement. It is split, outside the sandbox, into a probe (the expression
the solution must compute) and a check (what the probe's value must satisfy, with the expected
literal). Only the probes enter the sandbox: the program run there loads the solution, evaluates
each probe and prints its value's repr. The caller decodes those values as literals and applies
the checks itself. Expected values never reach the sandbox, so a solution that prints result lines
of its own (or reads the program it runs in) can only report answers; reporting the right ones is
solving the task. Two reports for one probe, or a missing end marker, fail the whole run.

    assert f(2) == 4         probe `f(2)`, check `== 4`
    assert 4 == f(2)         the same
    assert f(2) in (3, 4)    probe `f(2)`, check `in (3, 4)`
    assert not f(3)          probe `f(3)`, check falsy
    assert f(1) == f(2)      probe `f(1) == f(2)`, check truthy (no literal side: as strong as the test)
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from typing import Any

RESULT_MARK = "@@probe"
DONE_MARK = "@@probes-done"
MAX_VALUE_CHARS = 100_000

_OPS: dict[type, tuple[str, Any]] = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda value, expected: value in expected),
    ast.NotIn: ("not in", lambda value, expected: value not in expected),
    ast.Is: ("is", lambda value, expected: value is expected),
    ast.IsNot: ("is not", lambda value, expected: value is not expected),
}
# With the literal on the left, `L op probe` is checked as `probe op' L`.
_MIRROR = {
    ast.Lt: ast.Gt,
    ast.LtE: ast.GtE,
    ast.Gt: ast.Lt,
    ast.GtE: ast.LtE,
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
}


class CodeTestError(ValueError):
    """A test that is not a single assert statement (the message names tests[i])."""


@dataclass(frozen=True)
class Check:
    probe: str
    op: str  # "truthy", "falsy" or a comparison operator
    expected: Any = None

    def holds(self, value: Any) -> bool:
        if self.op == "truthy":
            return bool(value)
        if self.op == "falsy":
            return not value
        compare = next(fn for name, fn in _OPS.values() if name == self.op)
        try:
            return bool(compare(value, self.expected))
        except Exception:  # e.g. `<` between a str and an int: the test fails
            return False


@dataclass
class Outcome:
    passed: int
    total: int
    error: str = ""  # why the run gave no verdict (then passed is 0)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def parse_check(test: str, where: str) -> Check:
    if not isinstance(test, str):
        raise CodeTestError(f"{where}: must be a string, got {type(test).__name__}")
    try:
        tree = ast.parse(test)
    except SyntaxError as exc:
        raise CodeTestError(f"{where}: not valid Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise CodeTestError(f"{where}: must be a single assert statement, got {test[:80]!r}")
    expr = tree.body[0].test
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return Check(ast.unparse(expr.operand), "falsy")
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and type(expr.ops[0]) in _OPS:
        op_type = type(expr.ops[0])
        left, right = expr.left, expr.comparators[0]
        right_is_literal, right_value = _literal(right)
        left_is_literal, left_value = _literal(left)
        probe, value = None, None
        if right_is_literal and not left_is_literal:
            probe, value = left, right_value
        elif left_is_literal and not right_is_literal and op_type in _MIRROR:
            probe, value, op_type = right, left_value, _MIRROR[op_type]
        identity = op_type in (ast.Is, ast.IsNot)
        if probe is not None and (not identity or value is None or value is True or value is False):
            return Check(ast.unparse(probe), _OPS[op_type][0], value)
    return Check(ast.unparse(expr), "truthy")


def parse_tests(tests: list[str], field: str = "tests") -> list[Check]:
    """Checks for each test; CodeTestError naming `field[i]` for one that is not an assert."""
    if not tests:
        raise CodeTestError(f"{field}: must be a non-empty list")
    return [parse_check(test, f"{field}[{i}]") for i, test in enumerate(tests)]


def build_program(solution: str, checks: list[Check]) -> str:
    """The program run in the sandbox: it knows the probes, never the expected values."""
    probes = [c.probe for c in checks]
    return (
        "import sys as _sys\n"
        f"_probes = {json.dumps(probes)}\n"
        "_ns = {'__name__': 'solution'}\n"
        "try:\n"
        f"    exec(compile({solution!r}, 'solution.py', 'exec'), _ns)\n"
        "    _loaded = True\n"
        "except BaseException as _exc:\n"
        "    _loaded = False\n"
        "    print('load error:', type(_exc).__name__, _exc, file=_sys.stderr)\n"
        "for _i, _probe in enumerate(_probes if _loaded else []):\n"
        "    try:\n"
        "        _out = repr(eval(_probe, dict(_ns)))\n"
        "    except BaseException as _exc:\n"
        "        _out = '!' + type(_exc).__name__\n"
        f"    _sys.stdout.write('\\n{RESULT_MARK} ' + str(_i) + ' ' + _out.replace('\\n', ' ') + '\\n')\n"
        "    _sys.stdout.flush()\n"
        f"_sys.stdout.write('\\n{DONE_MARK}\\n')\n"
        "_sys.stdout.flush()\n"
    )


def score_output(stdout: str, checks: list[Check]) -> Outcome:
    """Pass count from the program's output, the checks applied here (outside the sandbox)."""
    total = len(checks)
    values: dict[int, str] = {}
    done = 0
    for line in stdout.splitlines():
        if line == DONE_MARK:
            done += 1
            continue
        if not line.startswith(RESULT_MARK + " "):
            continue
        index_text, _, value_text = line[len(RESULT_MARK) + 1 :].partition(" ")
        if not index_text.isdigit() or int(index_text) >= total:
            return Outcome(0, total, f"result for an unknown test {index_text[:20]!r}: output tampered with")
        index = int(index_text)
        if index in values:
            return Outcome(0, total, f"two results for test {index}: output tampered with")
        values[index] = value_text
    if done != 1:
        return Outcome(
            0, total, "tests did not finish" if done == 0 else "end marker repeated: tampered with"
        )
    passed = 0
    for index, check in enumerate(checks):
        text = values.get(index)
        if text is None or text.startswith("!") or len(text) > MAX_VALUE_CHARS:
            continue
        ok, value = _decode(text)
        if ok and check.holds(value):
            passed += 1
    return Outcome(passed, total)


def _decode(text: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
