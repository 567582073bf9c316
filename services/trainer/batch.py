"""Packed micro-batches: decoding from the packer's MicroBatch proto and the checks a batch must pass
before it may touch the weights.

A rejected batch raises :class:`BatchRejected` (a kit ``InvalidArgument`` and a ``ValueError``) whose
message names the micro-batch and the field. Checks run before any forward pass, and the ranks agree
on the verdict collectively (see worker.py), so a bad batch on one rank leaves every rank unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looprl.packer.v1 import packer_pb2
from services.kit.messages import micro_batch
from services.kit.messages.codec import CodecError, tensor_from_proto, tensor_to_proto
from services.trainer.errors import BatchRejected

# Sampler log-probs are <= 0; allow float noise from a different kernel.
_LOGPROB_SLACK = 1e-4


@dataclass
class PackedMicroBatch:
    """One packed micro-batch as torch tensors, all per-token tensors of length T."""

    step: int
    input_ids: torch.Tensor  # int64 [T]
    position_ids: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int64 [S+1]
    loss_mask: torch.Tensor  # float32 [T]
    advantages: torch.Tensor  # float32 [T]
    behaviour_logprobs: torch.Tensor  # float32 [T]
    versions: torch.Tensor  # int64 [T]
    global_loss_tokens: int
    global_sequences: int
    rank: int = 0
    index: int = 0
    count: int = 1
    rollout_ids: list[str] = field(default_factory=list)
    # Reward statistics of the whole step, carried for the step record (not used by the loss).
    step_reward_mean: float = 0.0
    step_reward_std: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        moved = {name: getattr(self, name).to(device) for name in micro_batch.TENSORS}
        return PackedMicroBatch(
            **{**self.__dict__, **moved},
        )


def from_proto(msg: packer_pb2.MicroBatch) -> PackedMicroBatch:
    """Decode (copying out of the message, which may be reused) and check the shapes agree."""
    where = f"micro_batch[step={msg.step}, rank={msg.rank}, index={msg.index}]"
    tensors = {}
    for name in micro_batch.TENSORS:
        if not msg.HasField(name):
            raise BatchRejected(f"{where}.{name}: missing")
        try:
            tensors[name] = tensor_from_proto(getattr(msg, name)).clone()
        except CodecError as exc:
            raise BatchRejected(f"{where}.{name}: {exc}") from None
    batch = PackedMicroBatch(
        step=msg.step,
        input_ids=tensors["input_ids"].long(),
        position_ids=tensors["position_ids"].long(),
        cu_seqlens=tensors["cu_seqlens"].long(),
        loss_mask=tensors["loss_mask"].float(),
        advantages=tensors["advantages"].float(),
        behaviour_logprobs=tensors["behaviour_logprobs"].float(),
        versions=tensors["versions"].long(),
        global_loss_tokens=msg.global_loss_tokens,
        global_sequences=msg.global_sequences,
        rank=msg.rank,
        index=msg.index,
        count=msg.count,
        rollout_ids=list(msg.rollout_ids),
        step_reward_mean=msg.step_reward_mean,
        step_reward_std=msg.step_reward_std,
    )
    if msg.num_tokens and msg.num_tokens != batch.num_tokens:
        raise BatchRejected(f"{where}.num_tokens: says {msg.num_tokens} but input_ids has {batch.num_tokens}")
    return batch


def to_proto(batch: PackedMicroBatch) -> packer_pb2.MicroBatch:
    """The packer's wire form (used by tests and the benchmark to feed the real decode path)."""
    return packer_pb2.MicroBatch(
        step=batch.step,
        rank=batch.rank,
        index=batch.index,
        count=batch.count,
        input_ids=tensor_to_proto(batch.input_ids.to(torch.int32)),
        position_ids=tensor_to_proto(batch.position_ids.to(torch.int32)),
        cu_seqlens=tensor_to_proto(batch.cu_seqlens.to(torch.int32)),
        loss_mask=tensor_to_proto(batch.loss_mask.float()),
        advantages=tensor_to_proto(batch.advantages.float()),
        behaviour_logprobs=tensor_to_proto(batch.behaviour_logprobs.float()),
        versions=tensor_to_proto(batch.versions.long()),
        rollout_ids=batch.rollout_ids,
        num_tokens=batch.num_tokens,
        global_loss_tokens=batch.global_loss_tokens,
        global_sequences=batch.global_sequences,
    )


def validate(batch: PackedMicroBatch, expected_step: int, vocab_size: int) -> None:
    """Every check a micro-batch must pass before training on it; raises BatchRejected."""
    where = f"micro_batch[step={batch.step}, index={batch.index}]"
    if batch.step < expected_step:
        raise BatchRejected(
            f"{where}.step: {batch.step} is from the past (the trainer has already trained {expected_step} steps)"
        )
    if batch.step != expected_step:
        raise BatchRejected(f"{where}.step: expected step {expected_step}, got {batch.step}")
    t = batch.num_tokens
    for name in micro_batch.PER_TOKEN:
        value = getattr(batch, name)
        if value.dim() != 1 or value.shape[0] != t:
            raise BatchRejected(
                f"{where}.{name}: has shape {list(value.shape)} but input_ids has {t} tokens; "
                "every per-token tensor must have the same length"
            )
    if t == 0:
        raise BatchRejected(f"{where}.input_ids: empty micro-batch")
    cu = batch.cu_seqlens
    if cu.dim() != 1 or cu.shape[0] < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
        raise BatchRejected(f"{where}.cu_seqlens: must run from 0 to {t}, got {cu.tolist()[:16]}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()):
        raise BatchRejected(
            f"{where}.cu_seqlens: sequences must be non-empty, got lengths {lengths.tolist()[:16]}"
        )
    seq_start = torch.repeat_interleave(cu[:-1], lengths)
    expected_positions = torch.arange(t) - seq_start
    if not torch.equal(batch.position_ids, expected_positions):
        bad = int((batch.position_ids != expected_positions).nonzero()[0])
        raise BatchRejected(
            f"{where}.position_ids: must restart at 0 for each sequence; token {bad} has "
            f"{int(batch.position_ids[bad])}, expected {int(expected_positions[bad])}"
        )
    if int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= vocab_size:
        raise BatchRejected(f"{where}.input_ids: token ids must be in [0, {vocab_size})")
    mask = batch.loss_mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise BatchRejected(f"{where}.loss_mask: must be 0 or 1")
    if bool((mask[cu[:-1]] != 0).any()):
        raise BatchRejected(f"{where}.loss_mask: the first token of a sequence has no prediction to train")
    for name in ("advantages", "behaviour_logprobs"):
        value = getattr(batch, name)
        if not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).nonzero()[0])
            raise BatchRejected(f"{where}.{name}: non-finite value {float(value[bad])} at token {bad}")
    if bool(((batch.behaviour_logprobs > _LOGPROB_SLACK) & (mask > 0)).any()):
        raise BatchRejected(f"{where}.behaviour_logprobs: log-probs must be <= 0")
    loss_tokens = int(mask.sum())
    if batch.global_loss_tokens < loss_tokens:
        raise BatchRejected(
            f"{where}.global_loss_tokens: {batch.global_loss_tokens} is less than this micro-batch's "
            f"{loss_tokens} loss tokens"
        )
    if batch.global_sequences < batch.num_sequences:
        raise BatchRejected(
            f"{where}.global_sequences: {batch.global_sequences} is less than this micro-batch's "
            f"{batch.num_sequences} sequences"
        )


def validate_rank_batches(batches: list[PackedMicroBatch], expected_step: int, vocab_size: int) -> None:
    """Per-batch checks plus the checks across one rank's micro-batches of a step."""
    if not batches:
        raise BatchRejected(f"micro_batches: no micro-batch for step {expected_step}")
    for batch in batches:
        validate(batch, expected_step, vocab_size)
    norms = {(b.global_loss_tokens, b.global_sequences) for b in batches}
    if len(norms) != 1:
        raise BatchRejected(
            f"micro_batches.global_loss_tokens: micro-batches of one step disagree: {sorted(norms)}"
        )
