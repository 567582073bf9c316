"""Group-relative advantage estimators and the group filters that go with them.

All estimators map one group's rewards (samples of the same prompt) to one scalar advantage per
sample; `per_token_advantages` spreads it over the sample's loss tokens only.

- grpo:    (r - mean) / (std + eps), std with ddof=0 (DeepSeekMath GRPO).
- dr_grpo: r - mean (Dr. GRPO: no std normalisation, which biases towards easy/hard prompts).
- rloo:    r_i - mean_{j != i} r_j (REINFORCE leave-one-out; unbiased baseline).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Estimator(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


def group_advantages(rewards: np.ndarray, estimator: Estimator | str, eps: float = 1e-6) -> np.ndarray:
    """One advantage per sample of a group. A group of one sample carries no signal: 0."""
    r = np.asarray(rewards, dtype=np.float64)
    n = r.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    est = Estimator(estimator)
    mean = r.mean()
    if est is Estimator.GRPO:
        adv = (r - mean) / (r.std() + eps)
    elif est is Estimator.DR_GRPO:
        adv = r - mean
    else:
        # mean of the others = (n*mean - r_i)/(n-1), so r_i - that = n/(n-1) * (r_i - mean)
        adv = (r - mean) * (n / (n - 1)) if n > 1 else np.zeros(n)
    return adv.astype(np.float32)


def has_signal(rewards: np.ndarray, atol: float = 1e-9) -> bool:
    """False when every sample of the group got the same reward: all advantages are zero."""
    r = np.asarray(rewards, dtype=np.float64)
    return r.shape[0] > 1 and float(r.max() - r.min()) > atol


def per_token_advantages(advantage: float, loss_mask: np.ndarray) -> np.ndarray:
    """The sample's advantage on its loss tokens, 0 elsewhere (float32 [L])."""
    return np.where(loss_mask, np.float32(advantage), np.float32(0.0)).astype(np.float32)


def batch_group_advantages(
    rewards: np.ndarray, group_sizes: np.ndarray, estimator: Estimator | str, eps: float = 1e-6
) -> np.ndarray:
    """`group_advantages` for many groups laid end to end (rewards of group k follow those of k-1)."""
    r = np.asarray(rewards, dtype=np.float64)
    sizes = np.asarray(group_sizes, dtype=np.int64)
    if r.size == 0:
        return np.zeros(0, dtype=np.float32)
    if sizes.min() <= 0 or sizes.sum() != r.size:
        raise ValueError("group_sizes: must be positive and sum to the number of rewards")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    mean = np.repeat(np.add.reduceat(r, starts) / sizes, sizes)
    centred = r - mean
    est = Estimator(estimator)
    if est is Estimator.GRPO:
        std = np.sqrt(np.add.reduceat(centred * centred, starts) / sizes)
        adv = centred / (np.repeat(std, sizes) + eps)
    elif est is Estimator.DR_GRPO:
        adv = centred
    else:
        n = np.repeat(sizes, sizes).astype(np.float64)
        adv = np.where(n > 1, centred * n / np.maximum(n - 1, 1), 0.0)
    return adv.astype(np.float32)
