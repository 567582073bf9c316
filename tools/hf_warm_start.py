"""Supervised warm start for tools/build_hf_model.py: teach a fresh model the math environment's format.

The shipped corpus's word problems become chat turns exactly as the math environment renders them
(user: "<question>\\n<instruction>", assistant: "<worked solution>\\n#### <n>" then <|im_end|>), and
the model is trained with next-token cross-entropy on the assistant tokens only, so an RL run
(configs/hf_math_grpo.toml) starts from a policy that answers in the right format and is sometimes
right, instead of from noise that never earns a reward. One thread and a seeded sampler make it
deterministic.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import torch
import torch.nn.functional as F


def chat_examples(corpus: str) -> list[tuple[list[dict[str, str]], str]]:
    """(prompt messages, assistant answer) for every worked problem of the corpus; ValueError if none."""
    examples = []
    for block in corpus.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 4 and lines[-1].startswith("#### ") and lines[1].startswith("Solve the problem."):
            user = f"{lines[0]}\n{lines[1]}"
            examples.append(([{"role": "user", "content": user}], "\n".join(lines[2:])))
    if not examples:
        raise ValueError("--sft-steps: the corpus holds no worked problems ending in '#### <n>'")
    return examples


def environment_examples(
    environment: str, config: dict[str, Any], count: int, seed: int
) -> list[tuple[list[dict[str, str]], str]]:
    """(prompt messages, target) of `count` tasks of an environment whose tasks carry an "answer",
    drawn and rendered as the environment-sandbox does for a run with this seed. The target is the
    task's worked "solution" where it has one (it ends in the answer), else the bare answer."""
    from services.environment_sandbox.environments.base import environment_class, parse_config
    from services.environment_sandbox.environments.datasets import task_by_index

    cls = environment_class(environment)
    parsed = parse_config(cls, config)
    examples = []
    for index in range(count):
        task = task_by_index(environment, index, seed, config)
        examples.append((asyncio.run(cls(parsed).reset(task)), str(task.get("solution", task["answer"]))))
    return examples


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[tuple[list[dict[str, str]], str]],
    steps: int,
    seed: int,
    batch: int = 16,
    lr: float = 3e-3,
) -> dict[str, float]:
    """Train `model` in place for `steps` AdamW steps on (prompt messages, answer) pairs; returns the
    first and last losses."""
    if not examples:
        raise ValueError("--sft-steps: no examples to learn from")
    encoded = []
    for messages, answer in examples:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        completion = [*tokenizer.encode(answer), tokenizer.eos_token_id]
        encoded.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in a fixed order: the same bytes on every machine
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    losses: list[float] = []
    try:
        model.train()
        for step in range(steps):
            chosen = [encoded[rng.randrange(len(encoded))] for _ in range(batch)]
            ids = torch.tensor([t for seq, _ in chosen for t in seq])
            mask = torch.tensor([m for _, ms in chosen for m in ms], dtype=torch.float32)
            lengths = [len(seq) for seq, _ in chosen]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
            positions = torch.cat([torch.arange(n) for n in lengths])
            logits = model(ids, positions, cu)
            # Predict token t+1 from position t, never across a sequence boundary.
            targets = torch.roll(ids, -1)
            weight = torch.roll(mask, -1)
            weight[cu[1:] - 1] = 0.0
            token_loss = F.cross_entropy(logits, targets, reduction="none")
            loss = (token_loss * weight).sum() / weight.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            # Cosine decay to 10%: the last steps settle instead of bouncing.
            for group in optimizer.param_groups:
                group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1))))
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])} if losses else {}
