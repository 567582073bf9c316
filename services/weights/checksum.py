"""Slice checksums that cost less than the copy they protect (hash64, sum64), and `verify_slice`,
the one check every receiver runs on a slice's bytes.

hash64 is XXH3-64 (seed 0) of the slice's bytes: ~30 GB/s in one thread, without the GIL, run
block by block right after each block is copied (the block is still in cache, so hashing costs
little more than the copy). Any corruption - a flipped byte, moved or swapped ranges, a wrong
length - goes unnoticed with probability about 2**-64, and XXH3 is a fixed, portable function:
every machine and language computes the same value. It is not a cryptographic MAC: it catches
accidents (transport bugs, reused buffers, wrong offsets), not an adversary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from .errors import ChecksumMismatch, InvalidWeights

BLOCK_BYTES = 256 << 10  # copy a block, hash it while it is still in L2
MASK = (1 << 64) - 1


def _as_u8(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


class Hasher64:
    """hash64 of a buffer that is being filled front to back: `advance(upto)` hashes the bytes
    [0, upto) not hashed yet, so callers copy a block and hash it while it is hot."""

    __slots__ = ("_h", "_pos", "_u8", "nbytes")

    def __init__(self, buf) -> None:
        self._u8 = _as_u8(buf)
        self.nbytes = int(self._u8.size)
        self._pos = 0
        self._h = xxhash.xxh3_64()

    def advance(self, upto: int) -> None:
        upto = min(upto, self.nbytes)
        if upto > self._pos:
            self._h.update(self._u8[self._pos : upto].data)
            self._pos = upto

    def digest(self) -> int:
        self.advance(self.nbytes)
        return self._h.intdigest()


def hash64(buf) -> int:
    """hash64 of a bytes-like object or array (its raw bytes)."""
    u8 = _as_u8(buf)
    return xxhash.xxh3_64_intdigest((u8 if u8.flags.c_contiguous else np.ascontiguousarray(u8)).data)


def copy_and_hash64(dest, src) -> int:
    """Copy src into dest (same byte length) block by block and return hash64 of what landed in
    dest, hashed while each block is still in cache. Verifying the destination checks the bytes
    that will actually be served, including the copy itself."""
    d, s = _as_u8(dest), _as_u8(src)
    if d.size != s.size:
        raise ValueError(f"copy of {s.size} bytes into {d.size}")
    h = xxhash.xxh3_64()
    for start in range(0, d.size, BLOCK_BYTES):
        stop = min(start + BLOCK_BYTES, d.size)
        np.copyto(d[start:stop], s[start:stop])
        h.update(d[start:stop].data)
    return h.intdigest()


# ------------------------------------------------------------------------------------- sum64
# sum64 = (nbytes + sum of the bytes' little-endian uint64 words) mod 2**64, last word zero-padded.
# A wrapping word sum runs at memory speed in numpy (faster still than hash64), so a
# receiver can check every byte it copies out of shared memory for little more than the copy.
# Any change confined to one word (in particular any single corrupted byte) changes the sum;
# unlike hash64 it does not see whole words swapped within a slice. Used where the bytes were
# already verified against the trainer's checksum once (shared-memory reshard-on-read).
SUM_BLOCK_BYTES = 512 << 10  # copy a block, sum it while it is still in L2


def _word_sum(u8: np.ndarray) -> int:
    """Sum of the words of a contiguous uint8 array whose length is a multiple of 8."""
    if not u8.size:
        return 0
    return int(u8.view(np.uint64).sum(dtype=np.uint64))


def _tail_sum(u8: np.ndarray) -> int:
    whole = u8.size // 8 * 8
    total = _word_sum(u8[:whole])
    if u8.size > whole:
        total += int.from_bytes(u8[whole:].tobytes(), "little")
    return total


def sum64(buf) -> int:
    """sum64 of a bytes-like object or contiguous array."""
    u8 = _as_u8(buf)
    return (u8.size + _tail_sum(u8)) & MASK


def sum64_rows(rows: np.ndarray) -> int:
    """sum64 of a 2-D uint8 array's rows taken in order (a rectangle of a bigger buffer)."""
    if rows.ndim != 2:
        return sum64(np.ascontiguousarray(rows).reshape(-1))
    n, width = rows.shape
    if width % 8 == 0 and rows.strides[1] == 1 and n:
        return (n * width + int(rows.view(np.uint64).sum(dtype=np.uint64))) & MASK
    return sum64(np.ascontiguousarray(rows).reshape(-1))


def copy_and_sum64(dest, src: np.ndarray) -> int:
    """Copy src (1-D uint8, or 2-D rows of a rectangle) into contiguous dest block by block and
    return sum64 of what landed in dest, summed while each block is still in cache."""
    d = _as_u8(dest)
    if src.ndim == 1:
        src = src.reshape(1, -1)
    n, width = src.shape
    if d.size != n * width:
        raise ValueError(f"copy of {n * width} bytes into {d.size}")
    step = max(1, SUM_BLOCK_BYTES // max(width, 1))
    if n == 1 and width > SUM_BLOCK_BYTES:  # one long row: cut it into word-aligned blocks
        flat = src.reshape(-1)
        total = 0
        for start in range(0, width, SUM_BLOCK_BYTES):
            stop = min(start + SUM_BLOCK_BYTES, width)
            np.copyto(d[start:stop], flat[start:stop])
            total += _tail_sum(d[start:stop]) if stop == width else _word_sum(d[start:stop])
        return (d.size + total) & MASK
    step = step // 8 * 8 or 8  # blocks of a multiple of 8 rows start on a word boundary
    total = 0
    for r in range(0, n, step):
        stop = min(r + step, n)
        block = d[r * width : stop * width]
        np.copyto(block.reshape(stop - r, width), src[r:stop])
        total += _tail_sum(block) if stop == n else _word_sum(block)
    return (d.size + total) & MASK


def landing_sums(rows: np.ndarray) -> np.ndarray | int:
    """What weight-sync records of a chunk (a (rows, row_bytes) uint8 array) when it lands: the
    word sum of every row when rows are whole words (so the sum64 of any run of whole rows follows
    without reading the bytes again, and any rectangle's rows can be re-checked), else the sum64
    of the whole chunk."""
    n, width = rows.shape
    if width % 8 == 0 and n and rows.flags.c_contiguous:
        return rows.view(np.uint64).sum(axis=1, dtype=np.uint64)
    return sum64(np.ascontiguousarray(rows).reshape(-1))


# ------------------------------------------------------------------------------ verification
# Who vouches for each kind of checksum, and what a mismatch means: hash64 is the sender's hash of
# the bytes it sent; sum64 comes from weight-sync's record of bytes it had already verified once.
_SOURCE = {
    "hash64": ("sender", "corrupted in transit"),
    "sum64": ("weight-sync", "changed after it was verified"),
}


@dataclass(frozen=True)
class SliceChecksum:
    """What a slice's bytes must hash to: a sum64 when weight-sync sent one, else a hash64."""

    kind: str  # "hash64" | "sum64"
    value: int

    @classmethod
    def of(cls, sl) -> SliceChecksum | None:
        """The checksum a WeightSlice carries; None when it carries none."""
        if sl.HasField("sum64"):
            return cls("sum64", int(sl.sum64))
        if sl.HasField("hash64"):
            return cls("hash64", int(sl.hash64))
        return None

    def compute(self, data) -> int:
        """This kind of checksum of data: bytes, a 1-D array, or 2-D rows of a rectangle."""
        if self.kind == "sum64":
            if isinstance(data, np.ndarray) and data.ndim == 2:
                return sum64_rows(data)
            return sum64(np.ascontiguousarray(_as_u8(data)))
        return hash64(data)

    def copy_and_compute(self, dest, src) -> int:
        """Copy src into dest block by block and return the checksum of what landed in dest."""
        if not isinstance(src, np.ndarray):
            src = _as_u8(src)
        if self.kind == "sum64":
            return copy_and_sum64(dest, src)
        if src.ndim != 1:
            src = np.ascontiguousarray(src).reshape(-1)
        return copy_and_hash64(dest, src)


def verify_slice(expected: SliceChecksum | None, data, *, where: str, what: str, into=None) -> None:
    """Check a slice's bytes against the checksum it came with; when `into` is given, copy data
    there first and check what landed (the bytes that will be served, the copy included). Raises
    ChecksumMismatch naming `where.<kind>` (e.g. slices[3].hash64) and `what` the bytes are, or
    InvalidWeights when the slice carries no checksum at all (nothing would vouch for its bytes)."""
    if expected is None:
        raise InvalidWeights(f"{where}.hash64: {what} carry no checksum (hash64 or sum64)")
    actual = expected.compute(data) if into is None else expected.copy_and_compute(into, data)
    if actual != expected.value:
        source, meaning = _SOURCE[expected.kind]
        raise ChecksumMismatch(
            f"{where}.{expected.kind}: {what} have {expected.kind} {actual:#018x}, {source} said "
            f"{expected.value:#018x} ({meaning})"
        )
