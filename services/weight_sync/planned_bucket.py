"""PlannedBucket: weight-sync's Bucket (services/weights/bucket.py), a planned bucket bound to the
chunk buffers of one version.

It fills itself straight from the trainer's chunks: a view of the chunk, one copy into the bucket
buffer (with the dtype cast when the target is bf16), one hash64 computed as the bytes land. For
gRPC, whose message join copies every byte anyway, `payload_parts` hands over slices that are
contiguous in their chunk as the chunk's own bytes (hashed in place), so they are copied once, not
twice. When the chunks sit in weight-sync's shared-memory arena, `shm_slices` names them in place
for co-located receivers (reshard-on-read) and `copy_to` writes a shared copy, each slice with the
sum64 its receiver must find (`expected_sums`, from the landing record).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from looprl.inference.v1 import inference_pb2
from services.weights import SliceRef, itemsize
from services.weights.checksum import BLOCK_BYTES, MASK, Hasher64, hash64, sum64, sum64_rows
from services.weights.errors import DeliveryError

from .plan import ChunkKey, CopyOp, PlannedBucketSpec


class ArenaChanged(DeliveryError):
    """Bytes of a chunk in shared memory differ from what was verified when it landed."""

    def __init__(self, key: ChunkKey) -> None:
        import grpc

        super().__init__(
            f"{key[0]} rows from {key[2]} (trainer rank {key[1]}): bytes in shared memory changed after "
            "they were verified (sum64 of their rows differs from when they landed)",
            code=grpc.StatusCode.DATA_LOSS,
        )


class PlannedBucket:
    """A planned bucket bound to the chunk buffers of one version: fills itself from them."""

    shareable = True

    def __init__(
        self,
        spec: PlannedBucketSpec,
        dtype: torch.dtype,
        chunks: Mapping[ChunkKey, torch.Tensor],
        locations: Mapping[ChunkKey, tuple[str, int]] | None = None,
        sums: Mapping[ChunkKey, object] | None = None,
    ) -> None:
        self._sums = sums  # checksum.landing_sums per chunk (recorded when it landed)
        self.spec = spec
        self._locations = locations  # chunk -> (shm segment, byte offset) when chunks live in shared memory
        self.index = spec.index
        self.count = spec.count
        self.nbytes = spec.nbytes
        self.dtype = dtype
        self._chunks = chunks  # 2-D views (rows, width) of each chunk's received bytes
        self.slices = [
            SliceRef(s.name, s.dtype, s.shape, s.offset, s.byte_start, s.nbytes) for s in spec.slices
        ]

    def _in_arena(self) -> bool:
        """Every slice can be read in place: its chunk lies in shared memory, with a landing record,
        in the target dtype."""
        locations, sums = self._locations, self._sums
        if not locations or sums is None:
            return False
        chunks = self._chunks
        return all(
            op.chunk in locations
            and op.chunk in sums
            and op.chunk in chunks
            and chunks[op.chunk].dtype == self.dtype
            for op in self.spec.ops
        )

    def expected_sums(self) -> list[int] | None:
        """The sum64 each slice must have as it lands (contiguous, in receiver order), or None when
        the chunks are not in shared memory (or a dtype cast is on the way).

        Sums come from what was recorded when the chunk landed (`landing_sums`, taken from the bytes
        its trainer checksum was verified on): a run of whole rows needs no read at all; a column
        block (row-parallel at tp > 1) reads its rows, re-checks their word sums against the landing
        record (ArenaChanged if they moved) and sums the block."""
        if not self._in_arena():
            return None
        assert self._sums is not None
        size = itemsize(self.dtype)
        out = []
        for op, ref in zip(self.spec.ops, self.slices, strict=True):
            chunk, landed = self._chunks[op.chunk], self._sums[op.chunk]
            row_bytes = chunk.shape[1] * size
            r0, r1 = op.row0, op.row0 + op.rows
            c0, c1 = op.col0 * size, (op.col0 + op.cols) * size
            u8 = chunk.view(torch.uint8).numpy()  # (rows, row_bytes) over the arena
            if isinstance(landed, np.ndarray):
                if c0 == 0 and c1 == row_bytes:  # whole rows
                    out.append((ref.nbytes + int(landed[r0:r1].sum(dtype=np.uint64))) & MASK)
                    continue
                now = u8[r0:r1].view(np.uint64).sum(axis=1, dtype=np.uint64)
                if not np.array_equal(now, landed[r0:r1]):
                    raise ArenaChanged(op.chunk)
            elif sum64(u8.reshape(-1)) != landed:
                raise ArenaChanged(op.chunk)
            out.append(sum64_rows(u8[r0:r1, c0:c1]))
        return out

    def shm_slices(self) -> list[inference_pb2.WeightSlice] | None:
        """Reshard-on-read: the bucket's slices as rectangles of the trainer chunks in shared
        memory, each with the sum64 its receiver must find in what it copies (`expected_sums`).
        None when a slice cannot be read in place."""
        sums = self.expected_sums()
        if sums is None:
            return None
        assert self._locations is not None
        size = itemsize(self.dtype)
        out = []
        for op, ref, want in zip(self.spec.ops, self.slices, sums, strict=True):
            segment, base = self._locations[op.chunk]
            row_bytes = self._chunks[op.chunk].shape[1] * size
            msg = ref.to_proto(shm_name=segment)
            msg.shm_offset = base + op.row0 * row_bytes + op.col0 * size
            if op.cols * size != row_bytes and op.rows > 1:  # a column block: a strided rectangle
                msg.shm_rows = op.rows
                msg.shm_row_stride = row_bytes
            msg.sum64 = want
            out.append(msg)
        return out

    def fill(self, dest: memoryview) -> None:
        """Copy every slice into dest and hash64 it, a few rows at a time so each block is hashed
        while it is still in cache (checksum.py); the hash covers the bytes actually sent."""
        out = torch.frombuffer(dest, dtype=torch.uint8, count=self.nbytes) if self.nbytes else None
        for op, ref in zip(self.spec.ops, self.slices, strict=True):
            self._fill_slice(op, ref, out)

    def copy_to(self, dests: Sequence[torch.Tensor]) -> None:
        """Copy slice i into dests[i] (uint8, its nbytes), cast to the target dtype: how a shared
        copy is written (transport/shared_copy.py). No hash: receivers check sums from the landing record."""
        for op, ref, dest in zip(self.spec.ops, self.slices, dests, strict=True):
            if ref.nbytes:
                src = self._chunks[op.chunk][op.row0 : op.row0 + op.rows, op.col0 : op.col0 + op.cols]
                dest.view(self.dtype).view(op.rows, op.cols).copy_(src)

    def payload_parts(self, scratch: memoryview) -> list[np.ndarray]:
        """The payload of every slice as a contiguous buffer, hash64 set, for a transport that
        copies the bytes anyway (gRPC joins them into the message): a slice that is a contiguous
        range of its chunk in the target dtype is the chunk's own bytes (hashed where they are, not
        copied a second time); any other slice is copied into scratch[byte_start:] as `fill` would."""
        out = None
        parts = []
        for op, ref in zip(self.spec.ops, self.slices, strict=True):
            chunk = self._chunks[op.chunk]
            src = chunk[op.row0 : op.row0 + op.rows, op.col0 : op.col0 + op.cols]
            if ref.nbytes and chunk.dtype == self.dtype and src.is_contiguous():
                raw = src.reshape(-1).view(torch.uint8).numpy()
                ref.hash64 = hash64(raw)
                parts.append(raw)
                continue
            if out is None:
                out = torch.frombuffer(scratch, dtype=torch.uint8, count=self.nbytes)
            self._fill_slice(op, ref, out)
            parts.append(out[ref.byte_start : ref.byte_start + ref.nbytes].numpy())
        return parts

    def _fill_slice(self, op: CopyOp, ref: SliceRef, out: torch.Tensor | None) -> None:
        if not ref.nbytes:
            ref.hash64 = hash64(b"")
            return
        size = itemsize(self.dtype)
        src = self._chunks[op.chunk][op.row0 : op.row0 + op.rows, op.col0 : op.col0 + op.cols]
        region = out[ref.byte_start : ref.byte_start + ref.nbytes]
        dst = region.view(self.dtype).view(op.rows, op.cols)
        hasher = Hasher64(region.numpy())
        row_bytes = op.cols * size
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        if src.dtype == dst.dtype:  # numpy: torch's copy_ forks OpenMP threads per 256 KiB block
            src, dst = src.view(torch.uint8).numpy(), dst.view(torch.uint8).numpy()
        for r in range(0, op.rows, step):
            stop = min(r + step, op.rows)
            if isinstance(dst, np.ndarray):
                np.copyto(dst[r:stop], src[r:stop])
            else:
                dst[r:stop].copy_(src[r:stop])
            hasher.advance(stop * row_bytes)
        ref.hash64 = hasher.digest()
