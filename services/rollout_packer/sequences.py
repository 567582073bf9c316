"""Rollout -> token sequence: the packer's unit of work, validated before anything else sees it.

A rollout's turns are concatenated into one sequence. Only tokens of trainable (model) turns are in
the loss; their behaviour log-probs and the weight version they were sampled under travel with them,
aligned token by token. A rollout that cannot be trained is turned into a `Rejected` outcome with a
reason from `DropReason`, so the service can term it on the bus and count it instead of redelivering
it forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from looprl.common.v1 import common_pb2

# Versions of tokens the model did not sample (prompt, environment): no version applies.
NO_VERSION = -1


class DropReason(StrEnum):
    """Why a rollout never reached (or never will reach) a trainer step. Values are metric labels."""

    MALFORMED = "malformed"
    MISSING_ID = "missing_id"
    RUN_MISMATCH = "run_mismatch"
    INVALID_GROUP_SIZE = "invalid_group_size"
    LOGPROB_LENGTH_MISMATCH = "logprob_length_mismatch"
    INVALID_LOGPROB = "invalid_logprob"
    INVALID_TOKEN = "invalid_token"
    NEGATIVE_VERSION = "negative_version"
    EMPTY_COMPLETION = "empty_completion"
    TRAINABLE_FIRST_TOKEN = "trainable_first_token"
    NON_FINITE_REWARD = "non_finite_reward"
    TOO_LONG = "too_long"
    DUPLICATE = "duplicate"
    ALREADY_TRAINED = "already_trained"
    LATE = "late"
    STRAGGLER_TIMEOUT = "straggler_timeout"
    STALE = "stale"
    GROUP_TOO_SMALL = "group_too_small"
    ZERO_VARIANCE_GROUP = "zero_variance_group"


@dataclass(frozen=True, slots=True)
class Rejected:
    """A rollout the packer will not train, and why."""

    rollout_id: str
    reason: DropReason
    detail: str = ""
    group_id: str = ""  # set where a whole group is judged (signal, staleness, stragglers)


@dataclass(frozen=True, slots=True, eq=False)
class TokenSequence:
    """One rollout as aligned per-token arrays (all of length `length`)."""

    rollout_id: str
    group_id: str
    group_size: int
    sample_index: int
    reward: float
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # bool [L]: sampled by the model, trained
    logprobs: np.ndarray  # float32 [L]: behaviour log-prob, 0 outside the mask
    versions: np.ndarray  # int64 [L]: weight version, NO_VERSION outside the mask
    min_version: int  # oldest version among the model's tokens (staleness is measured from it)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def sequence_from_rollout(
    rollout: common_pb2.Rollout,
    *,
    max_tokens: int | None = None,
    default_group_size: int | None = None,
    run_id: str | None = None,
) -> TokenSequence | Rejected:
    """Validate a rollout and build its token sequence, or say why it cannot be trained.

    `max_tokens`: the micro-batch token budget; a longer sequence can never be packed.
    `default_group_size`: the run's group size, used when the rollout does not carry one.
    `run_id`: when given, a rollout of another run is rejected.
    """
    rid = rollout.rollout_id

    def reject(reason: DropReason, detail: str) -> Rejected:
        return Rejected(rid, reason, detail)

    if not rid:
        return reject(DropReason.MISSING_ID, "rollout_id: empty")
    if not rollout.group_id:
        return reject(DropReason.MISSING_ID, "group_id: empty")
    if run_id is not None and rollout.run_id and rollout.run_id != run_id:
        return reject(DropReason.RUN_MISMATCH, f"run_id: {rollout.run_id!r} is not run {run_id!r}")
    group_size = rollout.group_size if rollout.group_size > 0 else (default_group_size or 0)
    if rollout.group_size < 0 or group_size <= 0:
        return reject(DropReason.INVALID_GROUP_SIZE, f"group_size: {rollout.group_size} must be > 0")
    if not math.isfinite(rollout.reward):
        return reject(DropReason.NON_FINITE_REWARD, f"reward: {rollout.reward} is not finite")
    if rollout.min_weight_version < 0:
        return reject(DropReason.NEGATIVE_VERSION, f"min_weight_version: {rollout.min_weight_version} < 0")

    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lp_parts: list[np.ndarray] = []
    ver_parts: list[np.ndarray] = []
    for i, turn in enumerate(rollout.turns):
        n = len(turn.token_ids)
        if n == 0:
            continue
        ids = np.asarray(turn.token_ids, dtype=np.int32)
        ids_parts.append(ids)
        if turn.trainable:
            if len(turn.logprobs) != n:
                return reject(
                    DropReason.LOGPROB_LENGTH_MISMATCH,
                    f"turns[{i}].logprobs: {len(turn.logprobs)} values for {n} token_ids",
                )
            if turn.weight_version < 0:
                return reject(
                    DropReason.NEGATIVE_VERSION, f"turns[{i}].weight_version: {turn.weight_version} < 0"
                )
            lp = np.asarray(turn.logprobs, dtype=np.float32)
            # A log-probability is finite and <= 0; small positive values are float noise.
            if not np.all(np.isfinite(lp)) or np.any(lp > 1e-4):
                return reject(DropReason.INVALID_LOGPROB, f"turns[{i}].logprobs: non-finite or > 0")
            mask_parts.append(np.ones(n, dtype=bool))
            lp_parts.append(lp)
            ver_parts.append(np.full(n, turn.weight_version, dtype=np.int64))
        else:
            mask_parts.append(np.zeros(n, dtype=bool))
            lp_parts.append(np.zeros(n, dtype=np.float32))
            ver_parts.append(np.full(n, NO_VERSION, dtype=np.int64))

    if not ids_parts:
        return reject(DropReason.EMPTY_COMPLETION, "turns: no tokens")
    input_ids = np.concatenate(ids_parts)
    loss_mask = np.concatenate(mask_parts)
    if not loss_mask.any():
        return reject(DropReason.EMPTY_COMPLETION, "turns: no trainable token")
    if loss_mask[0]:
        # The first token of a sequence has no context: its log-prob cannot be recomputed.
        return reject(DropReason.TRAINABLE_FIRST_TOKEN, "turns[0]: first token is trainable (no prompt)")
    if input_ids.min() < 0:
        return reject(DropReason.INVALID_TOKEN, "turns.token_ids: negative token id")
    if max_tokens is not None and input_ids.shape[0] > max_tokens:
        return reject(
            DropReason.TOO_LONG,
            f"turns: {input_ids.shape[0]} tokens > max_tokens_per_microbatch {max_tokens}",
        )
    versions = np.concatenate(ver_parts)
    return TokenSequence(
        rollout_id=rid,
        group_id=rollout.group_id,
        group_size=group_size,
        sample_index=rollout.sample_index,
        reward=float(rollout.reward),
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=np.concatenate(lp_parts),
        versions=versions,
        # The oldest version among the model's own tokens: the recorded field may be unset (0).
        min_version=int(versions[loss_mask].min()),
    )
