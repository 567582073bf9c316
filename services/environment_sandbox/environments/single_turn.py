"""single_turn: one prompt (or chat) from the run's dataset, one answer, scored by the run's reward.

The environment of a plain dataset: a row's `prompt` is shown as a user message (or its `messages`
as they are), the model answers once, and the reward (`reward.function`, or environment.reward;
`exact` by default) scores the answer against the row's `answer`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)


@dataclass
class SingleTurnConfig(EnvConfig):
    """A dataset's prompts, answered once."""

    system_prompt: str = ""
    """A system message shown before each prompt; empty: none."""
    instruction: str = ""
    """Text appended to a row's prompt (on a line of its own); empty: none."""


@register
class SingleTurnEnv(Environment):
    name = "single_turn"
    description = "A dataset's prompt (or chat messages), answered once; scored by the run's reward."
    default_reward = "exact"
    Config = SingleTurnConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        raise EnvironmentError_("environment: 'single_turn' takes its tasks from the recipe's [dataset]")

    def validate_task(self, task: dict[str, Any]) -> None:
        if not isinstance(task.get("prompt"), str) and not isinstance(task.get("messages"), list):
            raise EnvironmentError_("task_json: needs a string 'prompt' or a list 'messages'")

    async def _reset(self) -> list[Message]:
        assert isinstance(self.config, SingleTurnConfig)
        if isinstance(self.task.get("messages"), list):
            messages = [dict(m) for m in self.task["messages"]]
        else:
            prompt = self.task["prompt"]
            if self.config.instruction:
                prompt = f"{prompt}\n{self.config.instruction}"
            messages = [{"role": "user", "content": prompt}]
        if self.config.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    async def _step(self, action: str) -> StepResult:
        return StepResult([], 0.0, True, {})
