"""math: single-turn math word problems (GSM8K-style) with a numeric reference answer.

Tasks come from a local JSONL file ({"question", "answer"} per line; a GSM8K answer's
"#### 42" tail is understood) or, without a file, from a seeded generator of small arithmetic
problems. The reward is numeric equivalence of the completion's final answer. A task also carries
its worked solution where one is known (a GSM8K answer's text, the generator's own working), which a
supervised warm start (tools/hf_warm_start.py) learns from; the prompt never shows it.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
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
from services.environment_sandbox.environments.datasets import load_tasks


@dataclass
class MathConfig(EnvConfig):
    """Word problems with a numeric answer, from a dataset file or generated."""

    dataset: str = ""
    """Local JSONL/parquet file of {"question", "answer"} (and optionally "source", the row's task
    source); empty generates arithmetic problems."""
    instruction: str = "Solve the problem. End with '#### <number>'."
    """What the prompt asks of the model after the problem."""
    max_number: int = Field(50, ge=2, le=1_000_000)
    """Largest number a generated problem starts with or buys; smaller makes easier problems."""


@functools.lru_cache(maxsize=8)
def _dataset(path: str) -> tuple[dict[str, Any], ...]:
    if not Path(path).exists():
        raise EnvironmentError_(f"environment.config.dataset: file {path!r} does not exist")
    tasks = []
    for i, row in enumerate(load_tasks(path)):
        if not isinstance(row.get("question"), str) or "answer" not in row:
            raise EnvironmentError_(f"environment.config.dataset: row {i} needs 'question' and 'answer'")
        answer = str(row["answer"])
        task = {"question": row["question"], "answer": answer.rsplit("####", 1)[-1].strip()}
        if "####" in answer:
            task["solution"] = answer.strip()
        # A row's source (a mixture of datasets in one file) travels with the task: the agent loop
        # predicts output lengths per source.
        for key in ("source", "data_source"):
            if isinstance(row.get(key), str) and row[key]:
                task[key] = row[key]
        tasks.append(task)
    if not tasks:
        raise EnvironmentError_(f"environment.config.dataset: {path!r} holds no tasks")
    return tuple(tasks)


@register
class MathEnv(Environment):
    name = "math"
    description = "Math word problems with a numeric answer (GSM8K-style JSONL, or generated arithmetic)."
    default_reward = "math"
    Config = MathConfig

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        assert isinstance(config, MathConfig)
        if config.dataset:
            rows = _dataset(config.dataset)
            return dict(rows[rng.randrange(len(rows))])
        a, b, c = rng.randint(2, config.max_number), rng.randint(2, config.max_number), rng.randint(2, 9)
        left = a + b - c
        return {
            "question": f"Ann has {a} apples, buys {b} more, then gives away {c}. How many are left?",
            "answer": str(left),
            "solution": f"Ann has {a} + {b} = {a + b} apples. {a + b} - {c} = {left} are left.\n#### {left}",
        }

    def validate_task(self, task: dict[str, Any]) -> None:
        if not isinstance(task.get("question"), str) or not task["question"].strip():
            raise EnvironmentError_("task_json.question: must be a non-empty string")
        if "answer" not in task:
            raise EnvironmentError_("task_json.answer: missing")

    async def _reset(self) -> list[Message]:
        assert isinstance(self.config, MathConfig)
        return [{"role": "user", "content": f"{self.task['question']}\n{self.config.instruction}"}]

    async def _step(self, action: str) -> StepResult:
        return StepResult([], 0.0, True, {"answer": str(self.task["answer"])})
