"""The built-in environments, the registry's typed config, and the task sources."""

from __future__ import annotations

import json

import pytest

from services.environment_sandbox.environments import (
    EnvironmentError_,
    environment_names,
    generate_tasks,
    load_jsonl,
    make_environment,
    parse_task,
)
from services.environment_sandbox.environments.code import extract_code
from services.environment_sandbox.environments.digits import digits_score
from services.kit.usercode.code_tests import build_program, parse_tests, score_output


def test_registry_lists_the_builtins():
    assert {"digits", "guess", "code"} <= set(environment_names())


def test_unknown_environment_and_bad_config_name_the_field():
    with pytest.raises(EnvironmentError_, match="environment: unknown environment 'nope'"):
        make_environment("nope")
    with pytest.raises(
        EnvironmentError_,
        match=r"environment_config\.max_lenn: unknown field \(known: max_action_chars, max_episode_tokens, max_len, ",
    ):
        make_environment("digits", '{"max_lenn": 3}')
    with pytest.raises(
        EnvironmentError_, match=r"environment_config\.max_len: expected an integer, got str '3'"
    ):
        make_environment("digits", {"max_len": "3"})
    with pytest.raises(EnvironmentError_, match="task_json: not valid JSON"):
        parse_task("{oops")


def test_digits_score_gives_partial_credit_and_a_length_bonus():
    assert digits_score("4321", "4321") == pytest.approx(1.0)
    assert digits_score("4301", "4321") == pytest.approx(0.9 * 3 / 4 + 0.1)
    assert digits_score("43", "4321") == pytest.approx(0.9 * 2 / 4)
    assert digits_score("", "4321") == 0.0
    assert digits_score("xyzw", "4321") == pytest.approx(0.1)


async def test_digits_episode_is_single_turn_with_a_short_prompt():
    env = make_environment("digits")
    obs = await env.reset({"op": "rev", "digits": "3141"})
    assert obs == [{"role": "user", "content": "rev 3141"}]
    result = await env.step("1413")
    assert result.done and result.reward == pytest.approx(1.0)
    with pytest.raises(EnvironmentError_, match="already over"):
        await env.step("1")


async def test_digits_rejects_malformed_tasks_and_long_actions():
    env = make_environment("digits", {"max_action_chars": 8})
    with pytest.raises(EnvironmentError_, match=r"task_json\.digits"):
        await env.reset({"digits": "12a"})
    await env.reset({"digits": "12"})
    with pytest.raises(EnvironmentError_, match="action: 9 characters is longer than the limit 8"):
        await env.step("123456789")


def test_generators_are_seeded_and_tasks_are_valid():
    first = generate_tasks("digits", 20, seed=7)
    assert first == generate_tasks("digits", 20, seed=7)
    assert first != generate_tasks("digits", 20, seed=8)
    for task in first:
        assert 2 <= len(task["digits"]) <= 4 and task["answer"] == task["digits"][::-1]


async def test_guess_gives_feedback_and_rewards_fewer_turns():
    env = make_environment("guess", {"max_turns": 4})
    obs = await env.reset({"secret": 11, "high": 16})
    assert "1-16" in obs[0]["content"]
    step = await env.step("8")
    assert not step.done and step.observation[0]["content"] == "higher" and step.reward == 0
    step = await env.step("I think twelve")
    assert step.observation[0]["content"] == "number?"
    step = await env.step("11")
    assert step.done and step.reward == pytest.approx((4 - 3 + 1) / 4)


async def test_guess_ends_at_max_turns_without_reward():
    env = make_environment("guess", {"max_turns": 2})
    await env.reset({"secret": 3, "high": 16})
    await env.step("1")
    last = await env.step("2")
    assert last.done and last.reward == 0 and last.info["finish"] == "max_turns"


def test_code_program_counts_passes_and_extracts_fenced_code():
    text = "here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(text).strip().startswith("def add")
    checks = parse_tests(["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert not add(0, 0)"])
    program = build_program(extract_code(text), checks)
    assert "== 3" not in program  # the expected values stay out of what the sandbox runs
    namespace: dict = {}
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, namespace)
    outcome = score_output(out.getvalue(), checks)
    assert (outcome.passed, outcome.total, outcome.error) == (2, 3, "")


def test_code_checks_split_probe_from_expected_and_refuse_non_asserts():
    from services.kit.usercode.code_tests import Check, CodeTestError

    assert parse_tests(["assert 4 == f(2)"]) == [Check("f(2)", "==", 4)]
    assert parse_tests(["assert 5 > g(1)"]) == [Check("g(1)", "<", 5)]
    assert parse_tests(["assert f(1) is None"]) == [Check("f(1)", "is", None)]
    assert parse_tests(["assert f(1) == f(2)"]) == [Check("f(1) == f(2)", "truthy")]
    with pytest.raises(CodeTestError, match=r"tests\[0\]: must be a single assert"):
        parse_tests(["print(1)"])
    with pytest.raises(CodeTestError, match="non-empty"):
        parse_tests([])
    checks = parse_tests(["assert f(1) == 2"])
    assert score_output("@@probe 0 2\n@@probe 0 2\n@@probes-done\n", checks).error
    assert score_output("@@probe 0 2\n", checks).error == "tests did not finish"
    assert score_output("@@probe 0 2\n@@probes-done\n", checks).passed == 1
    assert score_output("@@probe 0 __import__('os')\n@@probes-done\n", checks).passed == 0


def test_jsonl_loader_names_the_bad_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"digits": "12"}) + "\n\n[1]\n")
    rows = load_jsonl(path)
    assert next(rows) == {"digits": "12"}
    with pytest.raises(EnvironmentError_, match=":3: each line must be a JSON object"):
        next(rows)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"ops": ["rot13"]}, "environment_config.ops[0]: must be one of 'rev' or 'copy', got 'rot13'"),
        ({"min_len": 5, "max_len": 3}, "environment_config.max_len: must be >= min_len (5)"),
        ({"max_len": 0}, "environment_config.max_len: must be >= 1, got 0"),
        ({"max_len": 3.0}, "environment_config.max_len: expected an integer, got float 3.0"),
    ],
)
def test_environment_settings_out_of_range_name_the_field_and_what_is_allowed(config, message):
    with pytest.raises(EnvironmentError_) as err:
        make_environment("digits", config)
    assert str(err.value) == message
