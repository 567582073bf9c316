"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine to min_lr_ratio)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class OptimizerSpec:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr: must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optimizer.schedule: unknown schedule {self.schedule!r} (constant, cosine)")
        if len(self.betas) != 2:
            raise ValueError(f"optimizer.betas: must have two values, got {self.betas}")


class LrSchedule:
    """Multiplier of the base lr at a step; a picklable callable so scheduler state round-trips."""

    def __init__(self, warmup_steps: int, schedule: str, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.schedule = schedule
        self.total_steps = max(total_steps, 1)
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / decay_steps, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def build_optimizer(
    params: list[torch.nn.Parameter], spec: OptimizerSpec
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    spec.validate()
    optimizer = torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=(spec.betas[0], spec.betas[1]),
        eps=spec.eps,
        weight_decay=spec.weight_decay,
    )
    schedule = LrSchedule(spec.warmup_steps, spec.schedule, spec.total_steps, spec.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
