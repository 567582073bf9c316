"""The peer bench's realistic shape: a ~10M-parameter Qwen2 answering math word problems in up to 96
tokens, learned by looprl and by TRL's GRPOTrainer from the same Hugging Face directory.

The shape is configs/math_10m_grpo.toml. Its model, models/qwen2-10m-math, is built offline by
tools/build_hf_model.py (byte-level BPE, Qwen chat template, 300 warm-start steps on 2,000 of the
environment's problems with their worked solutions, drawn with a seed no run uses) the first time it
is needed, and again when the warm start here changes; both sides load it from disk: TRL with
`AutoModelForCausalLM` / `AutoTokenizer`, looprl's services with their own loaders. Before measuring,
`check_parity` checks that the two loaders agree (token ids, chat template ids of the run's prompts,
logits). TRL's dataset is the run's tasks by the index the gateway publishes them by
(`task_by_index`, bench/peer_shape.py's `prompts`). The loss, optimizer and
sampling map exactly as for the tiny shape (shared/peer-trl-mapping.md), where one update on the
same completions is checked equal; here only the loaders differ.

A step samples 32 completions of up to 96 tokens (~35 in practice) from 4 prompts of ~69 tokens, so
generation and the update both weigh. looprl runs its best configuration for the shape, one step of
overlap between generation and training (max_staleness 1), while TRL stays synchronous; its update
computes each group's prompt once (services/modeling/shared_prefix.py). The warm-started model
answers in the worked form and is right 5-10% of the time, so groups often hold both a right and a
wrong answer; 30 steps do not raise the reward on either side, so the reward figure compares what
the two sample and train on at the same non-zero level, not yet a learning curve.

    make math-10m-model        (build the model alone; the bench builds it when missing)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

import torch

from bench.loop_harness import with_overrides
from bench.peer_shape import Shape, check_same_inputs
from services.kit.config.recipe import Recipe
from services.modeling.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "math_10m_grpo.toml"
MODEL_DIR = ROOT / "models" / "qwen2-10m-math"
# ~9.7M parameters: 12 layers of width 256, MLP 768, 8 query and 4 key/value heads of 32.
MODEL = ModelConfig.tiny(
    vocab_size=1024,  # the most the BPE may learn, specials included
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=2048,
)


def architecture() -> dict[str, int]:
    """MODEL as tools/build_hf_model.py's `build` takes it."""
    return {
        "vocab_size": MODEL.vocab_size,
        "hidden_size": MODEL.hidden_size,
        "intermediate_size": MODEL.intermediate_size,
        "num_layers": MODEL.num_hidden_layers,
        "num_heads": MODEL.num_attention_heads,
        "num_kv_heads": MODEL.num_key_value_heads,
        "head_dim": MODEL.head_dim,
        "max_positions": MODEL.max_position_embeddings,
    }


WARM_START_STEPS = 300
# The warm start learns this many of the environment's tasks (as the recipe configures it) with their
# worked solutions, drawn with a seed no run uses (a run draws its tasks with its own seed).
ENVIRONMENT_WARM_START_TASKS = 2000
WARM_START_TASK_SEED = 0
# looprl's best configuration for this shape (its figures: the peer_trl rows of docs/benchmarks.md).
LOOPRL_OVERRIDES: dict[str, dict[str, object]] = {"run": {"max_staleness": 1}}


def warm_start_examples() -> list[tuple[list[dict[str, str]], str]]:
    """(prompt messages, worked solution) pairs the model is warm-started on."""
    from services.kit.config.recipe import EnvironmentSection
    from tools.hf_warm_start import environment_examples

    # The recipe's environment section alone: the whole recipe only parses once the model exists.
    environment = EnvironmentSection.model_validate(tomllib.loads(RECIPE.read_text())["environment"])
    return environment_examples(
        environment.name, environment.config, ENVIRONMENT_WARM_START_TASKS, WARM_START_TASK_SEED
    )


def ensure_model() -> Path:
    """models/qwen2-10m-math, built once (deterministic: the same bytes on every machine) and again
    when what it is built from changed: the architecture, or the warm start (its steps, or the
    examples the recipe's environment config draws)."""
    examples = warm_start_examples()
    digest = hashlib.sha256(json.dumps([architecture(), WARM_START_STEPS, examples]).encode()).hexdigest()
    stamp = MODEL_DIR / "warm_start.sha256"  # written after the whole model
    if not (stamp.exists() and stamp.read_text() == digest):
        from tools.build_hf_model import build

        taught = f"{WARM_START_STEPS} SFT steps on {len(examples)} given answers"
        print(f"building {MODEL_DIR} ({taught}, a few minutes)", flush=True)
        build(MODEL_DIR, sft_steps=WARM_START_STEPS, sft_examples=examples, **architecture())
        stamp.write_text(digest)
    return MODEL_DIR


def recipe_text() -> str:
    """The recipe with the model's absolute path: both sides read it whatever their working directory."""
    model = str(ensure_model())
    return with_overrides(RECIPE.read_text(), model={"path": model, "tokenizer": model})


def trl_model(recipe: Recipe) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(recipe.model.path, dtype=torch.float32)


def trl_tokenizer(recipe: Recipe) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(recipe.model.tokenizer)


def math_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The stack's `math` reward (numeric equivalence of the final answer) on each completion's text."""
    from services.reward.verifiers import ScoreInput, numeric_equivalence

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]

    async def score() -> list[float]:
        return [
            await numeric_equivalence(ScoreInput(task={"answer": target}, completion=text))
            for text, target in zip(texts, answer, strict=True)
        ]

    return asyncio.run(score())


def check_parity(recipe: Recipe) -> None:
    """Raise unless TRL's and looprl's loaders read the same tokenizer, template and weights."""
    from services.modeling.qwen2 import Qwen2ForCausalLM
    from services.modeling.tokenizer import load_tokenizer

    texts = ("Ann has 12 apples.\n#### 38", "<|im_start|>user\nx<|im_end|>", "tab\there  é $5.50")
    ours = Qwen2ForCausalLM.from_pretrained(recipe.model.path)
    check_same_inputs(
        recipe,
        trl_tokenizer(recipe),
        load_tokenizer(recipe.model.tokenizer),
        texts,
        trl_model(recipe),
        ours,
        1e-4,
    )


REALISTIC = Shape(
    name="realistic",
    recipe_text=recipe_text,
    trl_model=trl_model,
    trl_tokenizer=trl_tokenizer,
    reward=math_reward,
    check_parity=check_parity,
    speed_target=">= 1.3",
    looprl_overrides=LOOPRL_OVERRIDES,
)


if __name__ == "__main__":
    print(ensure_model())
