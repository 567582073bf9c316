"""guess: multi-turn guess-the-number with higher/lower feedback between turns.

The environment answers each guess with "higher", "lower" or a request for a number; finding the
secret earns more the fewer turns it took, so the model is rewarded for using the feedback
(binary search), not for guessing at random.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)

_NUMBER = re.compile(r"-?\d+")


@dataclass
class GuessConfig(EnvConfig):
    """Guess a secret number in [1, high], told higher or lower after each guess."""

    max_turns: int = Field(6, ge=1, le=1024)
    """Guesses allowed."""
    high: int = Field(16, ge=2, le=1_000_000)
    """Largest secret."""


def guess_reward(turns_used: int, max_turns: int) -> float:
    """1.0 for a first-turn hit, falling linearly to 1/max_turns for a hit on the last turn."""
    return (max_turns - turns_used + 1) / max_turns


@register
class GuessEnv(Environment):
    name = "guess"
    description = "Guess a number in 1..N with higher/lower feedback; fewer turns earn more."
    multi_turn = True
    default_reward = "guess"
    Config = GuessConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        assert isinstance(config, GuessConfig)
        return {"secret": rng.randint(1, config.high), "high": config.high}

    def validate_task(self, task: dict[str, Any]) -> None:
        high = task.get("high", getattr(self.config, "high", 16))
        secret = task.get("secret")
        if not isinstance(high, int) or high < 1:
            raise EnvironmentError_("task_json.high: must be a positive integer")
        if not isinstance(secret, int) or not 1 <= secret <= high:
            raise EnvironmentError_(f"task_json.secret: must be an integer in 1..{high}")

    async def _reset(self) -> list[Message]:
        high = self.task.get("high", 16)
        return [{"role": "user", "content": f"guess 1-{high}"}]

    async def _step(self, action: str) -> StepResult:
        match = _NUMBER.search(action)
        secret = self.task["secret"]
        if match is None:
            return StepResult([{"role": "user", "content": "number?"}], 0.0, False, {"feedback": "invalid"})
        guess = int(match.group())
        if guess == secret:
            reward = guess_reward(self.turns, self.config.max_turns)
            return StepResult([], reward, True, {"feedback": "correct", "turns": str(self.turns)})
        feedback = "higher" if guess < secret else "lower"
        return StepResult([{"role": "user", "content": feedback}], 0.0, False, {"feedback": feedback})
