"""digits: reverse (or copy) a 2-4 digit string. Single turn, verifiable, learnable by a tiny
character-level model on CPU in minutes.

The prompt is a few characters ("rev 3141") because every prompt character is a token the tiny
model must attend over. The score gives partial credit per digit in the right position, plus a
small bonus for stopping at the right length, so a random model starts near zero but every
improvement (one more digit right, the right length) moves the reward: a dense learning signal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)
from services.kit.config.schema import field_error

OPS = {"rev": lambda s: s[::-1], "copy": lambda s: s}
LENGTH_BONUS = 0.1


def digits_score(answer: str, target: str) -> float:
    """0.9 * fraction of target positions answered right + 0.1 if the answer has the right length."""
    answer = answer.strip()
    if not target:
        return 0.0
    correct = sum(1 for a, t in zip(answer, target, strict=False) if a == t)
    return (1 - LENGTH_BONUS) * correct / len(target) + (LENGTH_BONUS if len(answer) == len(target) else 0.0)


@dataclass
class DigitsConfig(EnvConfig):
    """Digit strings to reverse or copy."""

    min_len: int = Field(2, ge=1, le=64)
    """Shortest digit string."""
    max_len: int = Field(4, ge=1, le=64)
    """Longest digit string."""
    ops: list[Literal["rev", "copy"]] = Field(["rev"], min_length=1)
    """What a task asks: reverse the string, or copy it."""

    @model_validator(mode="after")
    def _ordered(self) -> DigitsConfig:
        if self.min_len > self.max_len:
            raise field_error("max_len", f"must be >= min_len ({self.min_len})")
        return self


@register
class DigitsEnv(Environment):
    name = "digits"
    description = "Reverse or copy a short digit string; partial credit per digit in position."
    default_reward = "digits"
    Config = DigitsConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        assert isinstance(config, DigitsConfig)
        n = rng.randint(config.min_len, config.max_len)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        op = rng.choice(list(config.ops))
        return {"op": op, "digits": digits, "answer": OPS[op](digits)}

    def validate_task(self, task: dict[str, Any]) -> None:
        digits = task.get("digits")
        if not isinstance(digits, str) or not digits.isdigit():
            raise EnvironmentError_("task_json.digits: must be a non-empty string of digits")
        if task.get("op", "rev") not in OPS:
            raise EnvironmentError_(f"task_json.op: must be one of {sorted(OPS)}")

    def target(self) -> str:
        return OPS[self.task.get("op", "rev")](self.task["digits"])

    async def _reset(self) -> list[Message]:
        return [{"role": "user", "content": f"{self.task.get('op', 'rev')} {self.task['digits']}"}]

    async def _step(self, action: str) -> StepResult:
        score = digits_score(action, self.target())
        return StepResult([], score, True, {"target": self.target(), "score": f"{score:.4f}"})
