"""Request lengths for the simulator: a log-normal per stage, drifting between two shapes over a run.

RL workloads do not hold still: a reasoning policy's outputs lengthen as it trains (DeepSeek-R1's
grew several-fold), and an agent's contexts grow as its episodes take more turns. A `DriftingLengths`
moves each mean from its start to its end value, linearly between two steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Lengths:
    """Log-normal prompt and output lengths with these means and coefficient of variation."""

    mean_prompt: float
    mean_output: float
    cv: float = 0.5
    max_prompt: int = 131_072
    max_output: int = 65_536

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return (
            _lognormal(rng, self.mean_prompt, self.cv, self.max_prompt),
            _lognormal(rng, self.mean_output, self.cv, self.max_output),
        )


def _lognormal(rng: random.Random, mean: float, cv: float, cap: int) -> int:
    if cv <= 0:
        return max(1, min(cap, round(mean)))
    sigma = math.sqrt(math.log(1.0 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


@dataclass(frozen=True)
class DriftingLengths:
    """`start` until `drift_from`, `end` from `drift_to` on, linear in between."""

    name: str
    start: Lengths
    end: Lengths
    drift_from: int
    drift_to: int

    def at(self, step: int) -> Lengths:
        if step <= self.drift_from:
            return self.start
        if step >= self.drift_to:
            return self.end
        f = (step - self.drift_from) / max(1, self.drift_to - self.drift_from)
        return Lengths(
            self.start.mean_prompt + f * (self.end.mean_prompt - self.start.mean_prompt),
            self.start.mean_output + f * (self.end.mean_output - self.start.mean_output),
            self.start.cv + f * (self.end.cv - self.start.cv),
            self.end.max_prompt,
            self.end.max_output,
        )

    def groups(self, step: int, count: int, group_size: int, seed: int) -> list[tuple[int, list[int]]]:
        """`count` groups of the step (prompt tokens, output tokens of each of its `group_size`
        samples), the same for the same seed: a GRPO group's samples share their prompt."""
        rng = random.Random(f"{self.name}:{seed}:{step}")
        shape = self.at(step)
        out = []
        for _ in range(count):
            prompt, first = shape.sample(rng)
            out.append((prompt, [first, *(shape.sample(rng)[1] for _ in range(group_size - 1))]))
        return out
