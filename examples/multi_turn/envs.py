"""The environment of the multi-turn example: a relay of digits. Each turn the environment names a
digit ("say 7"), the model answers, and the environment names the next one; a turn earns 1 for the
right digit and 0.25 for any lone digit. Loaded by the environment-sandbox from a plugin directory
(`looprl up --plugin-dir examples/multi_turn`) as `environment.name = "envs.py:Relay"`.

A task is a dataset row {"prompt": "4821", "answer": "1"}: the digits to relay (the last one is the
reference answer the reward sees).
"""

import random
from typing import Any

from pydantic import Field

from services.environment_sandbox.environments import EnvConfig, Environment, EnvironmentError_, StepResult


class RelayConfig(EnvConfig):
    """Settings of the relay (the recipe's environment.config; environment.max_turns sets how many
    digits an episode relays), checked when the run is created."""

    lone_digit_credit: float = Field(0.25, ge=0.0, le=1.0)
    """Reward of a turn answered with a digit that is not the one named."""


class Relay(Environment):
    description = "Repeat the digit the environment names, turn after turn."
    multi_turn = True
    default_reward = "environment"
    Config = RelayConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        digits = "".join(rng.choice("0123456789") for _ in range(config.max_turns))
        return {"prompt": digits, "answer": digits[-1]}

    def validate_task(self, task: dict[str, Any]) -> None:
        if not str(task.get("prompt", "")).isdigit():
            raise EnvironmentError_("task_json.prompt: must be a string of digits")

    def _digit(self) -> str:
        digits = self.task["prompt"]
        return digits[min(self.turns, len(digits) - 1)]

    async def _reset(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"say {self._digit()}"}]

    async def _step(self, action: str) -> StepResult:
        said = action.strip()[:1]
        target = self.task["prompt"][min(self.turns - 1, len(self.task["prompt"]) - 1)]
        reward = 1.0 if said == target else self.config.lone_digit_credit if said.isdigit() else 0.0
        reward /= self.config.max_turns
        if self.turns >= min(self.config.max_turns, len(self.task["prompt"])):
            return StepResult([], reward, True, {"said": said})
        return StepResult(
            [{"role": "user", "content": f"say {self._digit()}"}], reward, False, {"said": said}
        )
