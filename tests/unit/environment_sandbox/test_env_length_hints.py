"""The agent loop predicts each model turn's output length per task source and sends it with the
request (GenerateRequest.expected_output_tokens), learning from the completions it gets back."""

from __future__ import annotations

import json

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime, task_source
from services.environment_sandbox.config import LoopConfig
from services.modeling.tokenizer import CharTokenizer

TOK = CharTokenizer()
LENGTHS = {"brief": 3, "worked": 40}


class LengthPolicy:
    """A Generator that answers a "brief" question in 3 tokens and a "worked" one in 40; records the
    hints it got."""

    def __init__(self) -> None:
        self.hints: list[tuple[str, int]] = []

    async def __call__(
        self, prompt_ids, sampling, session_id, min_weight_version, *, expected_output_tokens=0
    ):
        kind = "brief" if "brief" in TOK.decode(prompt_ids) else "worked"
        self.hints.append((kind, expected_output_tokens))
        ids = [TOK.encode("7")[0]] * (LENGTHS[kind] - 1) + [TOK.eos_token_id]
        return ModelTurn(ids, [-0.1] * len(ids), "stop", 0, kind)

    async def generate_n(
        self, prompt_ids, sampling, session_id, min_weight_version, n, *, expected_output_tokens=0
    ):
        args = (prompt_ids, sampling, session_id, min_weight_version)
        return [await self(*args, expected_output_tokens=expected_output_tokens) for _ in range(n)]


def math_task(i: int, source: str) -> events_pb2.EpisodeTask:
    payload = {"question": f"{source} question {i}", "answer": "7", "source": source}
    return events_pb2.EpisodeTask(
        run_id="r1",
        task_id=f"t{i}",
        group_id=f"g{i}",
        environment="math",
        task_json=json.dumps(payload),
        group_size=1,
        sampling=common_pb2.SamplingParams(max_tokens=64),
    )


async def test_each_source_gets_its_own_predicted_length_after_its_first_turn():
    policy = LengthPolicy()
    runner = EpisodeRunner(policy, None, TOK)
    for i in range(6):
        for source in ("brief", "worked"):
            await runner.run(math_task(i, source))
    first = {kind: hint for kind, hint in policy.hints[:2]}
    assert first == {"brief": 0, "worked": 0}  # nothing to go on yet: the router uses max_tokens
    later = policy.hints[2:]
    assert {hint for kind, hint in later if kind == "brief"} == {3}
    assert {hint for kind, hint in later if kind == "worked"} == {40}


async def test_no_hint_when_prediction_is_off_or_the_model_is_a_plain_function():
    policy = LengthPolicy()
    runner = EpisodeRunner(policy, None, TOK, config=LoopConfig(predict_output_lengths=False))
    for i in range(3):
        await runner.run(math_task(i, "brief"))
    assert [hint for _, hint in policy.hints] == [0, 0, 0]

    calls = []

    async def plain(prompt_ids, sampling, session_id, min_weight_version):
        calls.append(len(prompt_ids))
        return ModelTurn([TOK.eos_token_id], [-0.1], "stop", 0, "d")

    runner = EpisodeRunner(OneAtATime(plain), None, TOK)
    await runner.run(math_task(0, "brief"))
    await runner.run(math_task(1, "brief"))
    assert len(calls) == 2


def test_a_task_names_its_source_or_is_its_environments():
    assert task_source("math", {"question": "q", "source": "gsm8k"}) == "gsm8k"
    assert task_source("math", {"question": "q", "data_source": "openai/gsm8k"}) == "openai/gsm8k"
    assert task_source("digits", {"digits": "12"}) == "digits"
    assert task_source("digits", {"source": 3}) == "digits"  # not a name
