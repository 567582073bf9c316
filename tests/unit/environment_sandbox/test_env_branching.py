"""Episode forking: one episode played to turn k, then n continuations from the shared prefix,
each its own rollout (distinct deterministic ids, one group, one session for the router's cache).

The policy answers by sampling seed, so which branch says what is fixed whatever order the
concurrent branches run in; the real-router version of this lives in test_env_episodes_e2e.py."""

from __future__ import annotations

import json

import pytest

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime, rollout_id_for
from services.environment_sandbox.environments import EnvironmentError_
from services.environment_sandbox.environments.guess import guess_reward
from services.modeling.tokenizer import CharTokenizer

TOK = CharTokenizer()
SEED = 100
BIG = 104729  # the loop's per-branch seed offset


class SeededPolicy:
    """Replies by seed (default "1"); records every call. Samples one turn per call: the agent loop
    gets it as OneAtATime(policy)."""

    def __init__(self, replies: dict[int, str]) -> None:
        self.replies, self.calls = replies, []

    def _turn(self, seed: int) -> ModelTurn:
        ids = [*TOK.encode(self.replies.get(seed, "1")), TOK.eos_token_id]
        return ModelTurn(ids, [-0.5] * len(ids), "stop", 7)

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        self.calls.append((len(prompt_ids), session_id, sampling.seed, 1))
        return self._turn(sampling.seed)


class SeededGenerator(SeededPolicy):
    """A SeededPolicy that samples n turns of one prompt in one call, as the router does (a
    Generator: it takes the loop's length hint, and ignores it)."""

    async def __call__(
        self, prompt_ids, sampling, session_id, min_weight_version, *, expected_output_tokens=0
    ):
        return await super().__call__(prompt_ids, sampling, session_id, min_weight_version)

    async def generate_n(
        self, prompt_ids, sampling, session_id, min_weight_version, n, *, expected_output_tokens=0
    ):
        self.calls.append((len(prompt_ids), session_id, sampling.seed, n))
        return [self._turn(sampling.seed + i) for i in range(n)]  # the engines' seed + i convention


def runner(replies: dict[int, str], with_n: bool = False) -> tuple[SeededPolicy, EpisodeRunner]:
    policy = SeededGenerator(replies) if with_n else SeededPolicy(replies)
    return policy, EpisodeRunner(policy if with_n else OneAtATime(policy), None, TOK)


def fork_task(branch_at_turn: int, branches: int, max_turns: int = 4, **kw) -> events_pb2.EpisodeTask:
    return events_pb2.EpisodeTask(
        run_id="r",
        task_id="t",
        group_id="g",
        environment="guess",
        task_json=json.dumps({"secret": 10, "high": 16}),
        environment_config_json=json.dumps({"max_turns": max_turns}),
        group_size=2,
        sample_index=1,
        sampling=common_pb2.SamplingParams(max_tokens=4, seed=SEED),
        branch_at_turn=branch_at_turn,
        branches=branches,
        **kw,
    )


def base(turn: int, branch: int = 0) -> int:
    return SEED + 7919 * 1 + turn + BIG * branch


@pytest.mark.parametrize("with_n", [False, True])
async def test_fork_mid_episode_shares_the_prefix_and_branches_independently(with_n):
    replies = {
        base(0): "4",  # -> higher
        base(1) + 0: "10",  # branch 0 hits on turn 2
        base(1) + 1: "12",  # branch 1: lower, then ...
        base(2, 1): "10",  # ... hits on turn 3
        base(1) + 2: "11",  # branch 2: lower, then guesses 1 until max_turns
    }
    policy, loop = runner(replies, with_n)
    rollouts = await loop.run_all(fork_task(1, 3))

    assert [r.sample_index for r in rollouts] == [3, 4, 5]  # sample_index * branches + b
    assert all(r.group_size == 6 and r.group_id == "g" for r in rollouts)
    ids = [r.rollout_id for r in rollouts]
    assert ids == [rollout_id_for("r", "t", "g", 1, b) for b in range(3)] and len(set(ids)) == 3
    assert rollout_id_for("r", "t", "g", 1) not in ids  # a forked task never collides with an unforked one

    prefix = [list(t.token_ids) for t in rollouts[0].turns[:3]]
    for r in rollouts:
        assert [list(t.token_ids) for t in r.turns[:3]] == prefix
        assert TOK.decode(r.turns[1].token_ids, skip_special_tokens=True) == "4"
        assert r.turns[2].role == common_pb2.ROLE_ENVIRONMENT and not r.turns[2].trainable
    fork_replies = [TOK.decode(r.turns[3].token_ids, skip_special_tokens=True) for r in rollouts]
    assert fork_replies == ["10", "12", "11"]
    # Each branch's environment kept its own turn count: the reward depends on it.
    assert [r.reward for r in rollouts] == pytest.approx([guess_reward(2, 4), guess_reward(3, 4), 0.0])
    assert [len(r.turns) for r in rollouts] == [4, 6, 8]

    assert len({c[1] for c in policy.calls}) == 1  # one session: the router keeps them together
    fork_calls = [
        c
        for c in policy.calls
        if c[0] == len(rollouts[0].turns[0].token_ids) + len(prefix[1]) + len(prefix[2])
    ]
    assert sum(c[3] for c in fork_calls) == 3 and len(fork_calls) == (1 if with_n else 3)
    assert len(policy.calls) == 1 + len(fork_calls) + 1 + 2  # prefix, fork, branch 1 once, branch 2 twice


async def test_branch_at_turn_zero_is_n_samples_of_the_prompt():
    policy, loop = runner({base(0) + b: str(b + 9) for b in range(4)}, with_n=True)
    rollouts = await loop.run_all(fork_task(0, 4, max_turns=1))
    assert [TOK.decode(r.turns[1].token_ids, skip_special_tokens=True) for r in rollouts] == [
        "9",
        "10",
        "11",
        "12",
    ]
    assert [r.reward for r in rollouts] == [0.0, 1.0, 0.0, 0.0]
    assert policy.calls == [(len(rollouts[0].turns[0].token_ids), policy.calls[0][1], base(0), 4)]


async def test_episode_over_before_the_fork_point_forks_before_its_last_turn():
    _, loop = runner({base(0): "10", base(0) + 1: "3", base(0) + 2: "10"})
    rollouts = await loop.run_all(fork_task(3, 3))
    first = [TOK.decode(r.turns[1].token_ids, skip_special_tokens=True) for r in rollouts]
    assert first == ["10", "3", "10"]  # branch 0 is the played episode; 1 and 2 resampled turn 0
    assert rollouts[0].reward == rollouts[2].reward == 1.0 and rollouts[1].reward == 0.0
    assert len(rollouts[1].turns) == 8  # "3" then "1"s until max_turns


async def test_forking_tasks_need_run_all_and_sane_counts():
    _, loop = runner({})
    with pytest.raises(EnvironmentError_, match=r"task\.branches"):
        await loop.run(fork_task(1, 2))
    with pytest.raises(EnvironmentError_, match=r"task\.branches"):
        await loop.run_all(fork_task(1, 100000))
    single = await loop.run_all(fork_task(1, 1))
    assert len(single) == 1 and single[0].rollout_id == rollout_id_for("r", "t", "g", 1)
    assert single[0].sample_index == 1 and single[0].group_size == 2


async def test_a_forked_environment_plays_on_alone_and_shares_the_parsed_config():
    from services.environment_sandbox.environments.base import make_environment

    env = make_environment("guess", {"max_turns": 4})
    await env.reset({"secret": 5, "high": 16})
    await env.step("3")
    fork = env.fork()
    assert fork.config is env.config  # parsed once, never changed: not copied per branch
    assert fork.task == env.task and fork.task is not env.task
    result = await fork.step("5")
    assert result.done and fork.turns == 2
    assert not env.done and env.turns == 1
