"""Rule verifiers and weighted composition, including failed components reported with a reason."""

from __future__ import annotations

import asyncio

import pytest

from services.reward.registry import RewardRegistry, UnknownReward, default_registry
from services.reward.verifiers import ScoreInput, VerifierError, parse_number


def inp(task, completion, **kw) -> ScoreInput:
    return ScoreInput(task=task, completion=completion, **kw)


async def test_exact_and_numeric():
    reg = default_registry()
    assert (await reg.score("exact", inp({"answer": "Paris"}, "  paris "))).score == 1.0
    assert (await reg.score("exact", inp({"answer": "Paris"}, "Lyon"))).score == 0.0
    for answer in ("0.75", "3/4", "75%", "so the answer is \\boxed{3/4}", "#### 0.750"):
        out = await reg.score("numeric", inp({"answer": "3/4"}, answer))
        assert out.score == 1.0, answer
    assert (await reg.score("numeric", inp({"answer": "2^3"}, "I get 8"))).score == 1.0
    assert (await reg.score("numeric", inp({"answer": "8"}, "no idea"))).score == 0.0


def test_numeric_parser_refuses_code():
    with pytest.raises(VerifierError):
        parse_number("__import__('os').system('true')")
    with pytest.raises(VerifierError):
        parse_number("9**9**9")


async def test_digits_matches_the_environment_scorer():
    from services.environment_sandbox.environments.digits import digits_score

    reg = default_registry()
    task = {"op": "rev", "digits": "1234"}
    for answer in ("4321", "4301", "43", "", "43210", "abcd"):
        out = await reg.score("digits", inp(task, answer))
        assert out.ok and out.score == pytest.approx(digits_score(answer, "4321"))
    assert (await reg.score("digits_format", inp(task, "9999"))).score == 1.0
    assert (await reg.score("digits_format", inp(task, "99x9"))).score == 0.0


async def test_missing_reference_is_a_failed_component_not_a_silent_zero():
    out = await default_registry().score("exact", inp({}, "x"))
    assert not out.ok
    assert out.components[0].ok is False and "no reference answer" in out.components[0].reason
    env = await default_registry().score("guess", inp({}, "x"))
    assert not env.ok and "environment_reward" in env.components[0].reason
    code = await default_registry().score("code", inp({"tests": ["assert True"]}, "x"))
    assert not code.ok and "no sandbox configured" in code.components[0].reason


async def test_composition_weights_and_isolates_failures():
    reg = RewardRegistry(timeout_s=0.2)

    async def good(_):
        return 1.0

    async def slow(_):
        await asyncio.sleep(5)
        return 1.0

    async def crash(_):
        raise ZeroDivisionError("boom")

    reg.add_verifier("good", good, "")
    reg.add_verifier("slow", slow, "")
    reg.add_verifier("crash", crash, "")
    reg.add_composite("mix", [("good", 0.5), ("slow", 0.3), ("crash", 0.2)])
    out = await reg.score("mix", inp({}, ""))
    assert out.score == pytest.approx(0.5) and not out.ok
    reasons = {c.name: (c.ok, c.reason) for c in out.components}
    assert reasons["good"] == (True, "")
    assert reasons["slow"][0] is False and "timed out" in reasons["slow"][1]
    assert reasons["crash"][0] is False and "ZeroDivisionError: boom" in reasons["crash"][1]


async def test_unknown_reward_and_bad_composition_name_the_field():
    reg = default_registry()
    with pytest.raises(UnknownReward, match="reward: unknown reward 'nope'"):
        await reg.score("nope", inp({}, ""))
    with pytest.raises(ValueError, match=r"rewards\.bad: component 'missing'"):
        reg.add_composite("bad", [("missing", 1.0)])
