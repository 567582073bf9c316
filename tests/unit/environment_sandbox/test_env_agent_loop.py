"""The episode runner: chat-template token accounting, masks, log-probs, versions, rewards.

The model here is a scripted policy (fixed replies per turn) so the token layout can be checked
exactly; the end-to-end test through the real inference-router lives in tests/integration."""

from __future__ import annotations

import json

import pytest

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import (
    EpisodeRunner,
    ModelTurn,
    OneAtATime,
    Score,
    rollout_id_for,
)
from services.modeling.tokenizer import CharTokenizer, render_chatml
from services.reward.registry import default_registry
from services.reward.verifiers import ScoreInput

TOK = CharTokenizer()


class ScriptedPolicy:
    def __init__(self, replies: list[str], versions: list[int]) -> None:
        self.replies, self.versions, self.calls = replies, versions, []

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        i = len(self.calls)
        self.calls.append((list(prompt_ids), session_id, sampling.seed))
        ids = [*TOK.encode(self.replies[i]), TOK.eos_token_id]
        return ModelTurn(ids, [-0.25] * len(ids), "stop", self.versions[i], "r1/short")


async def registry_scorer(reward, task_json, completion, rollout_id, transcript, env_reward):
    out = await default_registry().score(
        reward, ScoreInput(json.loads(task_json), completion, transcript, env_reward)
    )
    return Score(out.score, out.as_dict(), out.ok)


def task(env: str, payload: dict, **kw) -> events_pb2.EpisodeTask:
    return events_pb2.EpisodeTask(
        run_id="r1",
        task_id="t1",
        group_id="g1",
        environment=env,
        task_json=json.dumps(payload),
        group_size=4,
        **kw,
    )


async def test_single_turn_digits_rollout_layout_and_reward():
    policy = ScriptedPolicy(["4301"], [5])
    runner = EpisodeRunner(OneAtATime(policy), registry_scorer, TOK)
    rollout = await runner.run(task("digits", {"digits": "1234"}, sample_index=2))
    prompt, answer = rollout.turns
    assert prompt.role == common_pb2.ROLE_USER and not prompt.trainable and not prompt.logprobs
    assert TOK.decode(prompt.token_ids) == render_chatml([{"role": "user", "content": "rev 1234"}])
    assert answer.trainable and answer.weight_version == 5
    assert answer.deployment == "r1/short" and not prompt.deployment  # who sampled each model turn
    assert len(answer.logprobs) == len(answer.token_ids) and answer.token_ids[-1] == TOK.eos_token_id
    assert rollout.reward == pytest.approx(0.9 * 3 / 4 + 0.1)
    assert rollout.rollout_id == rollout_id_for("r1", "t1", "g1", 2)
    assert rollout.sample_index == 2 and rollout.group_size == 4
    assert rollout.min_weight_version == rollout.max_weight_version == 5


async def test_multi_turn_guess_masks_environment_turns_and_tracks_versions():
    policy = ScriptedPolicy(["8", "12", "10"], [3, 4, 4])
    runner = EpisodeRunner(OneAtATime(policy), registry_scorer, TOK)
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=11)
    rollout = await runner.run(task("guess", {"secret": 10, "high": 16}, sampling=sampling))
    roles = [t.role for t in rollout.turns]
    assert roles == [
        common_pb2.ROLE_USER,
        common_pb2.ROLE_ASSISTANT,
        common_pb2.ROLE_ENVIRONMENT,
        common_pb2.ROLE_ASSISTANT,
        common_pb2.ROLE_ENVIRONMENT,
        common_pb2.ROLE_ASSISTANT,
    ]
    for turn in rollout.turns:
        assert turn.trainable == (turn.role == common_pb2.ROLE_ASSISTANT)
        assert bool(turn.logprobs) == turn.trainable
    assert (
        TOK.decode(rollout.turns[2].token_ids)
        == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    # The whole episode is exactly the chat template of the conversation.
    full = [i for t in rollout.turns for i in t.token_ids]
    conversation = [
        {"role": "user", "content": "guess 1-16"},
        {"role": "assistant", "content": "8"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "10"},
    ]
    assert TOK.decode(full) == render_chatml(conversation, add_generation_prompt=False).rstrip("\n")
    # Each model call saw the whole context so far, under one session id, with per-turn seeds.
    assert [len(c[0]) for c in policy.calls] == sorted(len(c[0]) for c in policy.calls)
    assert len({c[1] for c in policy.calls}) == 1
    assert len({c[2] for c in policy.calls}) == 3
    assert rollout.min_weight_version == 3 and rollout.max_weight_version == 4
    assert rollout.reward == pytest.approx((6 - 3 + 1) / 6)


async def test_too_long_action_ends_the_episode_unrewarded():
    policy = ScriptedPolicy(["9" * 50], [1])
    runner = EpisodeRunner(OneAtATime(policy), registry_scorer, TOK)
    rollout = await runner.run(
        task("digits", {"digits": "12"}, environment_config_json='{"max_action_chars": 10}')
    )
    assert rollout.finish_reason.startswith("env_error: action: 50 characters")
