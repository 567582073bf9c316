"""What the agent loop exchanges with the model and the reward: a sampled turn and a score.

The loop (agent_loop) and its gRPC adapters (clients) both speak these types; they live here so
neither of the two has to import the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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


class Generator(Protocol):
    """Samples one model turn. A generator may also take `expected_output_tokens=` (the turn's
    predicted length, which the router routes by); the agent loop passes it only to those that do."""

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
    ) -> ModelTurn: ...


@dataclass
class Score:
    score: float
    components: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    reasons: dict[str, str] = field(default_factory=dict)
    # A plugin reward's own code failed (ScoreResponse.plugin_error): the run cannot be scored.
    plugin_error: str = ""


# (reward name, task json, completion, rollout id, transcript, environment reward) -> Score; a plugin
# reward's settings come as the keyword config_json.
Scorer = Callable[..., Awaitable[Score]]
