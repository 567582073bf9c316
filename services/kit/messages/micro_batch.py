"""The tensors of a packed micro-batch (looprl.packer.v1.MicroBatch), named once for the packer that
builds them and the trainer that decodes and checks them: read from the contract itself, so a tensor
added to the message is carried by both."""

from __future__ import annotations

from looprl.packer.v1 import packer_pb2

# Every Tensor field of MicroBatch, in the message's order.
TENSORS: tuple[str, ...] = tuple(
    field.name
    for field in packer_pb2.MicroBatch.DESCRIPTOR.fields
    if field.message_type is not None and field.message_type.full_name == "looprl.common.v1.Tensor"
)
# The sequence boundaries [S+1]; every other tensor has one entry per token [T].
BOUNDARIES = "cu_seqlens"
PER_TOKEN: tuple[str, ...] = tuple(name for name in TENSORS if name != BOUNDARIES)
