"""The Bucket contract: a run of receiver slices whose bytes a sender assembles into one buffer.

A Bucket knows its slices (receiver name, dtype, full shape, element offset, where its bytes
sit in the bucket, checksum) and how to fill a destination buffer with its bytes. Checksums are
hash64 (checksum.py), computed block by block as the bytes land in the bucket. Transports decide
where that buffer lives (a gRPC message, a shared-memory segment, a device buffer); weight-sync's
reshard plan decides what goes in it (services/weight_sync/planned_bucket.py assembles straight
from the trainer's shard buffers, so no full copy of the model is ever made).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2

from .checksum import copy_and_hash64, hash64


@dataclass
class SliceRef:
    """One WeightSlice of a bucket: a contiguous element range of a receiver parameter."""

    name: str
    dtype: common_pb2.DType
    shape: tuple[int, ...]
    offset: int  # element offset into the flattened receiver parameter
    byte_start: int  # where its bytes start inside the bucket payload
    nbytes: int
    hash64: int | None = None

    def weight_slice(self, **fields: Any) -> inference_pb2.WeightSlice:
        """The WeightSlice naming this element range (name, dtype, shape, offset, nbytes), with
        `fields` set besides: no payload and no checksum unless given."""
        return inference_pb2.WeightSlice(
            name=self.name,
            dtype=self.dtype,
            shape=self.shape,
            offset=self.offset,
            nbytes=self.nbytes,
            **fields,
        )

    def to_proto(
        self, *, data: bytes | None = None, shm_name: str = "", shm_base: int = 0
    ) -> inference_pb2.WeightSlice:
        """The slice with its hash64, its payload inline (`data`) or where it sits in segment `shm_name`
        (whose byte `shm_base` is the bucket's first)."""
        msg = self.weight_slice()
        if self.hash64 is not None:
            msg.hash64 = self.hash64
        if data is not None:
            msg.data = data
        if shm_name:
            msg.shm_name = shm_name
            msg.shm_offset = shm_base + self.byte_start
        return msg


class Bucket(Protocol):
    """What a transport needs from a bucket."""

    index: int
    count: int
    nbytes: int
    slices: list[SliceRef]
    shareable: bool
    """Whether `copy_to` can write it into shared copies (services/weight_sync/transport/shared_copy.py)."""

    def fill(self, dest: memoryview) -> None:
        """Write the payload into dest[0:nbytes] and set every slice's hash64."""

    def payload_parts(self, scratch: memoryview) -> list[np.ndarray] | None:
        """Every slice's payload as a buffer, hash64 set, copying into scratch only what does not
        already sit contiguous; None when the bucket has no cheaper way than `fill`."""

    def shm_slices(self) -> list[inference_pb2.WeightSlice] | None:
        """The slices as ranges of shared memory their receiver reads in place; None when the
        bytes are not in shared memory."""

    def copy_to(self, dests: Sequence[Any]) -> None:
        """Copy slice i into dests[i] (uint8 tensors of its nbytes); only when `shareable`."""

    def expected_sums(self) -> list[int] | None:
        """The sum64 each slice must have as it lands, from weight-sync's record of bytes it already
        verified; None when there is no such record (then a shared copy is summed as written)."""


@dataclass
class BytesBucket:
    """A bucket whose payload already exists (tests, naive baselines, re-sends)."""

    index: int
    count: int
    slices: list[SliceRef]
    payload: bytes | bytearray | memoryview
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.payload)

    shareable = False

    def fill(self, dest: memoryview) -> None:
        out = np.frombuffer(dest, np.uint8, count=self.nbytes)
        src = np.frombuffer(self.payload, np.uint8)
        for s in self.slices:
            end = s.byte_start + s.nbytes
            s.hash64 = copy_and_hash64(out[s.byte_start : end], src[s.byte_start : end])

    def payload_parts(self, scratch: memoryview) -> None:
        return None

    def shm_slices(self) -> None:
        return None

    def copy_to(self, dests: Sequence[Any]) -> None:
        raise TypeError("a BytesBucket is not shareable: its payload is not laid out per slice")

    def expected_sums(self) -> None:
        return None


def set_checksums(slices: Sequence[SliceRef], payload: memoryview) -> None:
    for s in slices:
        s.hash64 = hash64(payload[s.byte_start : s.byte_start + s.nbytes])


def tensors_bucket(
    index: int, count: int, tensors: dict[str, object], dtype: common_pb2.DType
) -> BytesBucket:
    """A bucket carrying whole tensors (name -> torch tensor), one slice each."""
    import torch

    parts = []
    slices = []
    pos = 0
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        slices.append(SliceRef(name, dtype, tuple(t.shape), 0, pos, len(raw)))
        parts.append(raw)
        pos += len(raw)
    payload = b"".join(parts)
    set_checksums(slices, memoryview(payload))
    return BytesBucket(index, count, slices, payload)
