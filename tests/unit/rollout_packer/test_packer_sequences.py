"""Rollout -> token sequence: alignment of tokens, mask, log-probs and versions; bad rollouts rejected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.harness.synthetic_rollouts import make_rollout
from looprl.common.v1 import common_pb2
from services.rollout_packer.sequences import NO_VERSION, DropReason, Rejected, sequence_from_rollout


def test_multi_turn_rollout_is_aligned_token_by_token() -> None:
    r = common_pb2.Rollout(
        rollout_id="r1",
        group_id="g",
        group_size=2,
        reward=1.0,
        turns=[
            common_pb2.Turn(role=common_pb2.ROLE_USER, token_ids=[5, 6, 7]),
            common_pb2.Turn(token_ids=[8, 9], logprobs=[-0.5, -0.25], trainable=True, weight_version=3),
            common_pb2.Turn(role=common_pb2.ROLE_ENVIRONMENT, token_ids=[10]),
            common_pb2.Turn(token_ids=[11], logprobs=[-1.0], trainable=True, weight_version=4),
        ],
    )
    seq = sequence_from_rollout(r)
    assert not isinstance(seq, Rejected)
    assert seq.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert seq.loss_mask.tolist() == [False, False, False, True, True, False, True]
    assert seq.logprobs.tolist() == [0, 0, 0, -0.5, -0.25, 0, -1.0]
    assert seq.versions.tolist() == [NO_VERSION] * 3 + [3, 3, NO_VERSION, 4]
    # the oldest model version, from the turns (the rollout's own field was left at 0)
    assert seq.min_version == 3
    assert seq.input_ids.dtype == np.int32 and seq.logprobs.dtype == np.float32


def _bad(**changes) -> common_pb2.Rollout:
    r = make_rollout("r1", "g", completion_len=3)
    for key, value in changes.items():
        setattr(r, key, value)
    return r


@pytest.mark.parametrize(
    ("rollout", "reason", "field"),
    [
        (_bad(rollout_id=""), DropReason.MISSING_ID, "rollout_id"),
        (_bad(group_id=""), DropReason.MISSING_ID, "group_id"),
        (_bad(reward=math.nan), DropReason.NON_FINITE_REWARD, "reward"),
        (_bad(reward=math.inf), DropReason.NON_FINITE_REWARD, "reward"),
        (_bad(min_weight_version=-1), DropReason.NEGATIVE_VERSION, "min_weight_version"),
        (_bad(group_size=-2), DropReason.INVALID_GROUP_SIZE, "group_size"),
    ],
)
def test_bad_rollout_fields_are_rejected_with_reason(rollout, reason, field) -> None:
    out = sequence_from_rollout(rollout)
    assert isinstance(out, Rejected)
    assert out.reason is reason
    assert field in out.detail


def test_logprob_length_mismatch_is_rejected() -> None:
    r = make_rollout("r1", "g", completion_len=3)
    del r.turns[1].logprobs[-1]
    out = sequence_from_rollout(r)
    assert isinstance(out, Rejected) and out.reason is DropReason.LOGPROB_LENGTH_MISMATCH
    assert "turns[1].logprobs" in out.detail


def test_negative_turn_version_nan_logprob_and_negative_token_are_rejected() -> None:
    r = make_rollout("r1", "g")
    r.turns[1].weight_version = -3
    assert sequence_from_rollout(r).reason is DropReason.NEGATIVE_VERSION
    r = make_rollout("r1", "g")
    r.turns[1].logprobs[0] = math.nan
    assert sequence_from_rollout(r).reason is DropReason.INVALID_LOGPROB
    r = make_rollout("r1", "g")
    r.turns[1].logprobs[0] = 0.7  # a log-probability is never positive
    assert sequence_from_rollout(r).reason is DropReason.INVALID_LOGPROB
    r = make_rollout("r1", "g")
    r.turns[0].token_ids[0] = -1
    assert sequence_from_rollout(r).reason is DropReason.INVALID_TOKEN


def test_empty_completion_and_untrainable_first_token_are_rejected() -> None:
    r = make_rollout("r1", "g")
    del r.turns[1:]
    assert sequence_from_rollout(r).reason is DropReason.EMPTY_COMPLETION
    r = make_rollout("r1", "g")
    r.turns[1].ClearField("token_ids")
    r.turns[1].ClearField("logprobs")
    assert sequence_from_rollout(r).reason is DropReason.EMPTY_COMPLETION
    r = make_rollout("r1", "g")
    del r.turns[0]
    assert sequence_from_rollout(r).reason is DropReason.TRAINABLE_FIRST_TOKEN


def test_too_long_wrong_run_and_default_group_size() -> None:
    r = make_rollout("r1", "g", prompt_len=10, completion_len=10)
    assert sequence_from_rollout(r, max_tokens=19).reason is DropReason.TOO_LONG
    assert not isinstance(sequence_from_rollout(r, max_tokens=20), Rejected)
    assert sequence_from_rollout(r, run_id="other").reason is DropReason.RUN_MISMATCH
    r.group_size = 0
    assert sequence_from_rollout(r).reason is DropReason.INVALID_GROUP_SIZE
    assert sequence_from_rollout(r, default_group_size=4).group_size == 4
