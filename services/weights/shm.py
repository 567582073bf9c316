"""Reading weight-sync's shared-memory segments: the receiving side of the shm transports.

A segment is a plain file under the host's shm directory (services/kit/process/hosts.py shm_dir), written
by weight-sync (services/weight_sync/transport/arena.py) and mapped read-only here. Receivers never
own or unlink a segment, and only map names weight-sync could have made (`validate_segment_name`):
no paths, no other files. Unlinking a segment a receiver still maps is safe on Linux: the mapping
stays valid until it is closed.
"""

from __future__ import annotations

import mmap
import os
import re
import sys
import threading

import numpy as np

from services.kit.process.hosts import shm_dir

from .errors import InvalidWeights

PREFIX = "looprl-ws-"
# MAP_POPULATE is Linux-only; elsewhere pages fault in on first read.
_POPULATE: int = mmap.MAP_POPULATE if sys.platform == "linux" else 0
_NAME = re.compile(r"^looprl-ws-(\d+)-[A-Za-z0-9_.-]+$")


def validate_segment_name(name: str) -> str:
    """Receivers only map names weight-sync could have made: no paths, no other files."""
    if not _NAME.match(name):
        raise InvalidWeights(f"slices.shm_name: {name!r} is not a weight-sync segment name")
    return name


def segment_pid(name: str) -> int | None:
    """The pid of the process that created a segment (its name carries it); None if not ours."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


class ShmReader:
    """Maps segments read-only by name. A receiver keeps one for its lifetime: weight-sync reuses
    its segments, and a mapping that stays open keeps its page tables, where a fresh mapping per
    bucket page-faults on every 4 KiB of it (that alone cost more than the copy). `refresh()`
    (at the start of each staging call) drops mappings whose file is gone or was replaced, so a
    dead sender's segments are not kept alive by their mappings."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, memoryview, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        validate_segment_name(name)
        with self._lock:
            entry = self._maps.get(name)
            if entry is None:
                entry = self._map(name)
                self._maps[name] = entry
        mapped, view, _ = entry
        if offset < 0 or nbytes < 0 or offset + nbytes > len(mapped):
            raise InvalidWeights(
                f"slices.shm_offset: range [{offset}, {offset + nbytes}) is outside segment {name!r} "
                f"of {len(mapped)} bytes"
            )
        return view[offset : offset + nbytes]

    def rows(self, name: str, offset: int, rows: int, row_bytes: int, stride: int):
        """A read-only (rows, row_bytes) uint8 array over a rectangle of a segment: rows
        `stride` bytes apart starting at `offset` (a column block of a trainer chunk)."""
        if rows <= 0 or row_bytes < 0 or stride < row_bytes:
            raise InvalidWeights(
                f"slices.shm_row_stride: {rows} rows of {row_bytes} bytes {stride} bytes apart is not a rectangle"
            )
        span = (rows - 1) * stride + row_bytes
        flat = np.frombuffer(self.view(name, offset, span), dtype=np.uint8)
        return np.lib.stride_tricks.as_strided(flat, (rows, row_bytes), (stride, 1), writeable=False)

    def slice_bytes(self, i: int, sl) -> memoryview | bytes | np.ndarray:
        """The bytes WeightSlice `i` names, without copying them: inline data, a range of a segment,
        or a rectangle of one (reshard-on-read: rows of a trainer chunk)."""
        if sl.shm_name and sl.shm_rows:
            rows, nbytes = int(sl.shm_rows), int(sl.nbytes)
            if nbytes % rows:
                raise InvalidWeights(
                    f"slices[{i}].shm_rows: {nbytes} bytes do not split into {rows} equal rows"
                )
            return self.rows(sl.shm_name, int(sl.shm_offset), rows, nbytes // rows, int(sl.shm_row_stride))
        if sl.shm_name:
            return self.view(sl.shm_name, int(sl.shm_offset), int(sl.nbytes))
        data = sl.data  # once: each access of a protobuf bytes field copies it
        if sl.nbytes and sl.nbytes != len(data):
            raise InvalidWeights(f"slices[{i}].nbytes: {sl.nbytes} but data holds {len(data)} bytes")
        return data

    @staticmethod
    def _map(name: str) -> tuple[mmap.mmap, memoryview, tuple[int, int]]:
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise InvalidWeights(f"slices.shm_name: segment {name!r} does not exist") from None
        try:
            st = os.fstat(fd)
            # Populate the page tables in one go: faulting 4 KiB pages one by one on first read
            # costs more than the copy itself.
            flags = mmap.MAP_SHARED | _POPULATE
            mapped = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return mapped, memoryview(mapped), (st.st_ino, st.st_size)

    def refresh(self) -> None:
        """Forget mappings of segments that were removed or replaced since they were mapped."""
        with self._lock:
            for name, (_, _, ident) in list(self._maps.items()):
                try:
                    st = os.stat(shm_dir() / name)
                    current = (st.st_ino, st.st_size)
                except FileNotFoundError:
                    current = None
                if current != ident:
                    self._unmap(name)

    def _unmap(self, name: str) -> None:
        mapped, view, _ = self._maps.pop(name)
        try:
            view.release()
            mapped.close()
        except (BufferError, ValueError):
            pass  # a slice of it is still being read; the mapping goes when that view does

    def close(self) -> None:
        with self._lock:
            for name in list(self._maps):
                self._unmap(name)

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
