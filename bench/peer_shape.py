"""What bench/peer_trl.py's shapes share: the shape's description, the run's tasks as TRL's dataset
rows, and the check that TRL and looprl read the same inputs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.environment_sandbox.environments.base import make_environment
from services.environment_sandbox.environments.datasets import task_by_index
from services.kit.config.recipe import Recipe


@dataclass(frozen=True)
class Shape:
    """What the bench's shapes differ in: the recipe, TRL's copies of the model and tokenizer, the
    reward as TRL calls it, the parity check, and looprl's best configuration for the shape."""

    name: str
    recipe_text: Callable[[], str]
    """The shape's recipe (building what it needs first)."""
    trl_model: Callable[[Recipe], Any]
    trl_tokenizer: Callable[[Recipe], Any]
    reward: Callable[..., list[float]]
    check_parity: Callable[[Recipe], None]
    speed_target: str
    looprl_overrides: dict[str, dict[str, object]] = field(default_factory=dict)
    """Recipe settings only looprl's run gets (e.g. asynchronous mode); TRL stays synchronous."""
    single_process: bool = False
    """Also run looprl's libraries in one process (bench/single_process_grpo.py wires digits only)."""
    noise_floor: bool = True
    """Also run TRL on a second sampling stream: the spread of two equal learners."""


def prompts(recipe: Recipe) -> list[dict[str, Any]]:
    """The run's tasks in the order the gateway publishes them (task step*groups + g), as chat rows."""
    env_name, config = recipe.environment.name, recipe.environment.config
    rows = []
    for index in range(recipe.run.steps * recipe.groups_per_step):
        task = task_by_index(env_name, index, recipe.run.seed, config)
        messages = asyncio.run(make_environment(env_name, config).reset(task))
        rows.append({"prompt": messages, "answer": task["answer"]})
    return rows


def check_same_inputs(
    recipe: Recipe, theirs_tok: Any, ours_tok: Any, texts: tuple[str, ...], theirs: Any, ours: Any, tol: float
) -> None:
    """Raise unless TRL's and looprl's tokenizers agree on `texts` and on the run's first prompts
    (chat template included), and their models give the same logits on the first prompt."""
    for text in texts:
        ids = ours_tok.encode(text)
        assert theirs_tok.encode(text, add_special_tokens=False) == ids, f"token ids differ: {text!r}"
        assert theirs_tok.decode(ids) == ours_tok.decode(ids), f"decode differs: {text!r}"
    rows = prompts(recipe)
    for row in rows[:5]:
        ids = theirs_tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == ours_tok.apply_chat_template(row["prompt"]), "chat template ids differ"
    ids = torch.tensor(ours_tok.apply_chat_template(rows[0]["prompt"]))
    with torch.no_grad():
        diff = float((theirs(ids[None]).logits[0] - ours(ids)).abs().max())
    assert diff < tol, f"initial logits differ by {diff}"
