"""Slice checksums that cost less than the copy they protect: hash64.

CRC32 (zlib) runs at 4-7 GB/s on our CPUs, a memcpy at 10-20 GB/s: on the shared-memory path
a CRC per slice on each side was most of the time of a sync. hash64 is a multilinear hash
modulo 2**64, run block by block right after each block is copied (the block is still in
cache, so the hash costs little more than the copy):

    words   = the bytes as little-endian uint64 (the last 1-7 bytes zero-padded to a word)
    block   = BLOCK_WORDS consecutive words (256 KiB); the last block may be shorter
    d_b     = sum_j KEYS[j] * word[b * BLOCK_WORDS + j]             (mod 2**64)
    h       = nbytes;  for every block: h = h * FOLD + d_b           (mod 2**64)
    tail    = the zero-padded last word, when nbytes % 8 != 0:  h = h * FOLD + KEYS[0] * tail

KEYS are odd (splitmix64 of their index), so a change confined to one word - in particular
any single corrupted byte - always changes d_b, and `h -> h * FOLD + d` (FOLD odd) is a
bijection, so it always changes the result: the same guarantee CRC32 gives for a single
byte. Keys differ per position inside a block and blocks are chained, so moved or swapped
ranges are caught too; a random multi-word corruption goes unnoticed with probability about
2**-64. Modular sums do not depend on the order of additions, so every numpy build and
machine computes the same value. It is not a cryptographic MAC (neither is CRC32): it
catches accidents (transport bugs, reused buffers, wrong offsets), not an adversary.
"""

from __future__ import annotations

import numpy as np

BLOCK_WORDS = 1 << 15
BLOCK_BYTES = BLOCK_WORDS * 8
MASK = (1 << 64) - 1
FOLD = 0x9E3779B97F4A7C15


def _keys(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(FOLD)).astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


KEYS = _keys(BLOCK_WORDS)
_KEY0 = int(KEYS[0])


def _as_u8(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _block(words: np.ndarray) -> int:
    return int(np.dot(words, KEYS[: words.size]))


class Hasher64:
    """hash64 of a buffer that is being filled front to back: `advance(upto)` hashes every whole
    block of bytes [0, upto) not hashed yet, so callers copy a block and hash it while it is hot."""

    __slots__ = ("_h", "_pos", "_u8", "nbytes")

    def __init__(self, buf) -> None:
        self._u8 = _as_u8(buf)
        self.nbytes = int(self._u8.size)
        self._pos = 0
        self._h = self.nbytes & MASK

    def advance(self, upto: int) -> None:
        u8, pos, h = self._u8, self._pos, self._h
        while pos + BLOCK_BYTES <= upto:
            h = (h * FOLD + _block(u8[pos : pos + BLOCK_BYTES].view(np.uint64))) & MASK
            pos += BLOCK_BYTES
        self._pos, self._h = pos, h

    def digest(self) -> int:
        self.advance(self.nbytes)
        u8, pos, h = self._u8, self._pos, self._h
        whole = (self.nbytes - pos) // 8 * 8
        if whole:
            h = (h * FOLD + _block(u8[pos : pos + whole].view(np.uint64))) & MASK
        rest = self.nbytes - pos - whole
        if rest:
            tail = int.from_bytes(u8[pos + whole :].tobytes(), "little")
            h = (h * FOLD + _KEY0 * tail) & MASK
        self._pos, self._h = self.nbytes, h
        return h


def hash64(buf) -> int:
    """hash64 of a bytes-like object or array (its raw bytes)."""
    return Hasher64(buf).digest()


def copy_and_hash64(dest, src) -> int:
    """Copy src into dest (same byte length) block by block and return hash64 of what landed in
    dest, hashed while each block is still in cache. Verifying the destination checks the bytes
    that will actually be served, including the copy itself."""
    d, s = _as_u8(dest), _as_u8(src)
    if d.size != s.size:
        raise ValueError(f"copy of {s.size} bytes into {d.size}")
    hasher = Hasher64(d)
    for start in range(0, d.size, BLOCK_BYTES):
        stop = min(start + BLOCK_BYTES, d.size)
        np.copyto(d[start:stop], s[start:stop])
        hasher.advance(stop)
    return hasher.digest()


# ------------------------------------------------------------------------------------- sum64
# sum64 = (nbytes + sum of the bytes' little-endian uint64 words) mod 2**64, last word zero-padded.
# A wrapping word sum runs at memory speed in numpy (hash64's keyed dot product does not), so a
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
