"""Materialising one packed micro-batch: the arrays the trainer feeds to a varlen/packed forward.

Sequences are concatenated without padding. `position_ids` restart at 0 for each sequence and
`cu_seqlens` marks the boundaries, so attention stays block-diagonal. A bin left empty by the plan
(fewer sequences than ranks x micro-batches) becomes a padding micro-batch: one `pad_token_id` token,
loss mask 0, no rollout ids. Every rank then runs the same number of forward/backward passes (FSDP
collectives would hang otherwise) and the padding contributes nothing to the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.kit.messages import micro_batch
from services.rollout_packer.sequences import NO_VERSION, TokenSequence


@dataclass(frozen=True, eq=False)
class PackedMicroBatch:
    step: int
    rank: int
    index: int
    count: int
    input_ids: np.ndarray  # int32 [T]
    position_ids: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int32 [S+1]
    loss_mask: np.ndarray  # float32 [T]
    advantages: np.ndarray  # float32 [T], 0 outside the mask
    behaviour_logprobs: np.ndarray  # float32 [T], 0 outside the mask
    versions: np.ndarray  # int64 [T], NO_VERSION outside the mask
    rollout_ids: list[str]
    global_loss_tokens: int
    global_sequences: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_padding(self) -> bool:
        return not self.rollout_ids

    def to_torch(self) -> dict[str, object]:
        """The per-token arrays as torch tensors (sharing memory with the numpy arrays)."""
        import torch

        return {name: torch.from_numpy(getattr(self, name)) for name in micro_batch.TENSORS}


def build_micro_batch(
    sequences: Sequence[TokenSequence],
    advantages: np.ndarray,
    *,
    step: int,
    rank: int,
    index: int,
    count: int,
    global_loss_tokens: int,
    global_sequences: int,
    pad_token_id: int = 0,
) -> PackedMicroBatch:
    """Concatenate `sequences` (with one advantage each) into one packed micro-batch."""
    meta = {
        "step": step,
        "rank": rank,
        "index": index,
        "count": count,
        "global_loss_tokens": global_loss_tokens,
        "global_sequences": global_sequences,
    }
    if not sequences:
        return PackedMicroBatch(
            input_ids=np.array([pad_token_id], dtype=np.int32),
            position_ids=np.zeros(1, dtype=np.int32),
            cu_seqlens=np.array([0, 1], dtype=np.int32),
            loss_mask=np.zeros(1, dtype=np.float32),
            advantages=np.zeros(1, dtype=np.float32),
            behaviour_logprobs=np.zeros(1, dtype=np.float32),
            versions=np.full(1, NO_VERSION, dtype=np.int64),
            rollout_ids=[],
            **meta,
        )
    lens = np.fromiter((s.length for s in sequences), dtype=np.int64, count=len(sequences))
    cu = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    mask = np.concatenate([s.loss_mask for s in sequences]).astype(np.float32)
    adv = np.repeat(np.asarray(advantages, dtype=np.float32), lens)
    adv *= mask
    return PackedMicroBatch(
        input_ids=np.concatenate([s.input_ids for s in sequences]),
        position_ids=(np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens)).astype(np.int32),
        cu_seqlens=cu.astype(np.int32),
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=np.concatenate([s.logprobs for s in sequences]),
        versions=np.concatenate([s.versions for s in sequences]),
        rollout_ids=[s.rollout_id for s in sequences],
        **meta,
    )
