"""Trainer step time with a group's prompt computed once vs once per sample (the same loss and gradient).

The measured path is the trainer's own step math (services/trainer/step.py `accumulate`: forward,
policy loss, backward over the step's packed micro-batches) with `share_prompts` on; the baseline is
the same call with it off, so every sample's copy of the prompt goes through the model. Same weights,
same rollouts, alternated and timed after a warm-up. Two shapes, the peer bench's: the default
recipe's (tiny-qwen2, 8 groups of 8, ~20-token prompts, 4-token answers) and the realistic one's
(~10M-parameter Qwen2, 4 groups of 8, 69-token prompts, answers of ~37 tokens, up to 96). One thread:
the trainer rank's default (LOOPRL_TRAINER_THREADS).

    python -m bench.shared_prompts [--quick]
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from bench.common import emit, median, parse_args
from bench.peer_trl_realistic import MODEL as REALISTIC_MODEL
from services.kit.config.recipe import AlgorithmSection
from services.modeling.config import ModelConfig, model_preset
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.trainer.batch import PackedMicroBatch
from services.trainer.step import StepSettings, accumulate

BENCH = "shared_prompts"


def group_batches(
    groups: int, group_size: int, prompt_len: int, answer_lens: list[int], vocab: int, budget: int
) -> list[PackedMicroBatch]:
    """The step's rollouts, a group's samples after one another, packed into micro-batches of at
    most `budget` tokens as the rollout-packer fills them."""
    rng = np.random.default_rng(0)
    sequences = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        for k in range(group_size):
            answer = rng.integers(0, vocab, answer_lens[g * group_size + k]).tolist()
            sequences.append((prompt, answer))
    batches, current = [], []
    for seq in sequences:
        if current and sum(len(p) + len(a) for p, a in current) + len(seq[0]) + len(seq[1]) > budget:
            batches.append(current)
            current = []
        current.append(seq)
    batches.append(current)
    loss_tokens = sum(len(a) for _, a in sequences)
    return [packed(b, loss_tokens, len(sequences), seed=i) for i, b in enumerate(batches)]


def packed(
    sequences: list[tuple[list[int], list[int]]],
    loss_tokens: int = 0,
    count: int = 0,
    seed: int = 0,
) -> PackedMicroBatch:
    """(prompt, answer) pairs packed as the rollout-packer does: the answers trained, with random
    advantages and behaviour log-probs; `loss_tokens`/`count` are the whole step's (0: this batch's)."""
    gen = torch.Generator().manual_seed(seed)
    ids, positions, mask, bounds = [], [], [], [0]
    for prompt, answer in sequences:
        ids += prompt + answer
        positions += list(range(len(prompt) + len(answer)))
        mask += [0.0] * len(prompt) + [1.0] * len(answer)
        bounds.append(len(ids))
    loss_mask = torch.tensor(mask)
    return PackedMicroBatch(
        step=0,
        input_ids=torch.tensor(ids),
        position_ids=torch.tensor(positions),
        cu_seqlens=torch.tensor(bounds),
        loss_mask=loss_mask,
        advantages=torch.randn(len(ids), generator=gen) * loss_mask,
        behaviour_logprobs=-torch.rand(len(ids), generator=gen) * 3 * loss_mask,
        versions=torch.zeros(len(ids), dtype=torch.long),
        global_loss_tokens=loss_tokens or int(loss_mask.sum()),
        global_sequences=count or len(sequences),
    )


def measure(name: str, config: ModelConfig, batches: list[PackedMicroBatch], repeat: int) -> None:
    model = Qwen2ForCausalLM(config, seed=0)
    algorithm = AlgorithmSection(loss_aggregation="token-mean")
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeat + 1):
        for share in (False, True):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            accumulate(model, batches, StepSettings(loss=algorithm, share_prompts=share), trainer_version=0)
            if i:  # the first round warms up
                seconds[share].append(time.perf_counter() - start)
    shared, plain = 1 / median(seconds[True]), 1 / median(seconds[False])
    tokens = sum(b.num_tokens for b in batches)
    print(
        f"[{name}] {len(batches)} micro-batches, {tokens} tokens: prompt once per group "
        f"{1000 / shared:.1f} ms, once per sample {1000 / plain:.1f} ms"
    )
    # Per round: the plain step's seconds over the shared one's, measured back to back.
    rounds = [p / s for p, s in zip(seconds[False], seconds[True], strict=True)]
    emit(
        BENCH,
        f"step_speedup_{name}",
        shared,
        plain,
        shared / plain,
        "steps/s (forward + backward)",
        ">= 1.5",
        samples=rounds,
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    repeat = 3 if args.quick else 10
    rng = np.random.default_rng(1)
    measure("tiny", model_preset("tiny-qwen2"), group_batches(8, 8, 20, [4] * 64, 64, 2048), repeat)
    sigma = math.log(96 / 37) / 3
    answers = np.clip(rng.lognormal(math.log(37), sigma, 32), 8, 96).astype(int).tolist()
    measure(
        "realistic",
        REALISTIC_MODEL,
        group_batches(4, 8, 69, answers, REALISTIC_MODEL.vocab_size, 4096),
        max(1, repeat // 3),
    )


if __name__ == "__main__":
    main()
