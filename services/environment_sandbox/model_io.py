"""What the agent loop exchanges with the model and the reward: a sampled turn and a score, and
the typed seams it calls them through (Generator, Scorer; OneAtATime makes a Generator of a plain
one-turn function).

The loop (agent_loop) and its gRPC adapters (clients) both speak these types; they live here so
neither of the two has to import the other. The seams are checked by the type checker
(`make check`, tests/unit/test_types.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from looprl.common.v1 import common_pb2


@dataclass
class ModelTurn:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    deployment: str = ""
    adapter: str = ""


class TurnSampler(Protocol):
    """Samples one model turn: the least a model side provides (a test's policy, a plain function)."""

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        /,
    ) -> ModelTurn: ...


class Generator(TurnSampler, Protocol):
    """What the agent loop samples from: one turn, or `n` turns of one prompt in one call (a fork;
    a generator that can, prefills the shared prefix once). Turn b of n is sampled with seed
    `sampling.seed + b` (0: unseeded), the engines' convention. `expected_output_tokens` is each
    turn's predicted length (0: unknown), which the router routes by; a generator may ignore it."""

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> ModelTurn: ...

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        n: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> list[ModelTurn]: ...


class OneAtATime(Generator):
    """A Generator over a TurnSampler: n turns are n concurrent calls on the same session, turn b
    seeded `sampling.seed + b`. A plain sampler takes no length hint, so none is passed on."""

    def __init__(self, sample: TurnSampler) -> None:
        self.sample = sample

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> ModelTurn:
        return await self.sample(prompt_ids, sampling, session_id, min_weight_version)

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        n: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> list[ModelTurn]:
        async def one(b: int) -> ModelTurn:
            single = common_pb2.SamplingParams()
            single.CopyFrom(sampling)
            single.seed = sampling.seed + b if sampling.seed else 0
            return await self.sample(prompt_ids, single, session_id, min_weight_version)

        return list(await asyncio.gather(*(one(b) for b in range(n))))


@dataclass
class Score:
    score: float
    components: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    reasons: dict[str, str] = field(default_factory=dict)
    # A plugin reward's own code failed (ScoreResponse.plugin_error): the run cannot be scored.
    plugin_error: str = ""


class Scorer(Protocol):
    """Scores one finished episode with the named reward (the reward service, or a test's own); a
    plugin reward's settings come as the keyword `config_json`, passed only when the task has any."""

    async def __call__(
        self,
        reward: str,
        task_json: str,
        completion: str,
        rollout_id: str,
        transcript: str,
        environment_reward: float | None,
        /,
        *,
        config_json: str = "",
    ) -> Score: ...
