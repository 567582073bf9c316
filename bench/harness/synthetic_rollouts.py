"""Synthetic rollouts with realistic (heavy-tailed) lengths, for tests and benchmarks (bench/)."""

from __future__ import annotations

import numpy as np

from looprl.common.v1 import common_pb2


def lognormal_lengths(
    n: int, rng: np.random.Generator, median: float = 1000.0, max_len: int = 16384, min_len: int = 8
) -> np.ndarray:
    """Heavy-tailed sequence lengths: log-normal around `median`, sigma chosen so that the 1-in-10,000
    tail reaches `max_len`, clipped to [min_len, max_len]."""
    if not 0 < median < max_len:
        raise ValueError(f"median {median} must lie in (0, max_len={max_len})")
    sigma = np.log(max_len / median) / 3.72  # z of the 1e-4 upper quantile
    return np.clip(rng.lognormal(np.log(median), sigma, n), min_len, max_len).astype(np.int64)


def make_rollout(
    rollout_id: str,
    group_id: str,
    *,
    prompt_len: int = 4,
    completion_len: int = 4,
    reward: float = 0.0,
    version: int = 0,
    group_size: int = 2,
    sample_index: int = 0,
    run_id: str = "run",
    seed: int = 0,
    env_turn_len: int = 0,
) -> common_pb2.Rollout:
    """A rollout: a prompt turn, a model turn, and optionally an environment turn plus a second model turn."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(1, 1000, n).tolist()

    def model_turn(n: int) -> common_pb2.Turn:
        return common_pb2.Turn(
            role=common_pb2.ROLE_ASSISTANT,
            token_ids=tokens(n),
            logprobs=(-rng.random(n)).tolist(),
            trainable=True,
            weight_version=version,
        )

    turns = [common_pb2.Turn(role=common_pb2.ROLE_USER, token_ids=tokens(prompt_len))]
    if env_turn_len:
        half = max(1, completion_len // 2)
        turns += [
            model_turn(half),
            common_pb2.Turn(role=common_pb2.ROLE_ENVIRONMENT, token_ids=tokens(env_turn_len)),
            model_turn(completion_len - half),
        ]
    else:
        turns.append(model_turn(completion_len))
    return common_pb2.Rollout(
        rollout_id=rollout_id,
        run_id=run_id,
        group_id=group_id,
        turns=turns,
        reward=reward,
        group_size=group_size,
        sample_index=sample_index,
        min_weight_version=version,
        max_weight_version=version,
    )


def make_sequences(lengths: np.ndarray, group_size: int, rng: np.random.Generator, version: int = 0) -> list:
    """Token sequences (already validated form) of the given lengths, in groups of `group_size`,
    with a short prompt and the rest a model completion. Built directly as views into pooled arrays
    (fast, for benchmarks)."""
    from services.rollout_packer.sequences import NO_VERSION, TokenSequence

    lens = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    total = int(ends[-1]) if lens.size else 0
    prompt = np.clip(lens - 1, 1, 64)
    pos = np.arange(total) - np.repeat(starts, lens)
    mask = pos >= np.repeat(prompt, lens)
    ids = rng.integers(1, 32000, total, dtype=np.int32)
    logprobs = np.where(mask, -rng.random(total, dtype=np.float32), np.float32(0))
    versions = np.where(mask, version, NO_VERSION).astype(np.int64)
    rewards = (rng.random(lens.size) < 0.5).astype(np.float64)
    return [
        TokenSequence(
            rollout_id=f"r{i:07d}",
            group_id=f"g{i // group_size:06d}",
            group_size=group_size,
            sample_index=i % group_size,
            reward=float(rewards[i]),
            input_ids=ids[s:e],
            loss_mask=mask[s:e],
            logprobs=logprobs[s:e],
            versions=versions[s:e],
            min_version=version,
        )
        for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True))
    ]
