"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine to 0), built from the
recipe's [optimizer] section (services/kit/config/recipe.py:OptimizerSection, validated there) as is."""

from __future__ import annotations

import math

import torch

from services.kit.config.recipe import OptimizerSection


class LrSchedule:
    """Multiplier of the base lr at a step; a picklable callable so scheduler state round-trips."""

    def __init__(self, warmup_steps: int, schedule: str, total_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.schedule = schedule
        self.total_steps = max(total_steps, 1)

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / decay_steps, 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: list[torch.nn.Parameter], opt: OptimizerSection, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with `opt`'s settings and its schedule over `total_steps` (the run's steps)."""
    optimizer = torch.optim.AdamW(
        params,
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        # The multi-tensor update (PyTorch chooses it by itself only for CUDA tensors): the same
        # arithmetic as the per-parameter loop, without a Python loop over the parameters.
        foreach=True,
    )
    schedule = LrSchedule(opt.warmup_steps, opt.schedule, total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
