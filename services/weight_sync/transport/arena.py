"""Shared-memory segments weight-sync writes: bucket pools, chunk arenas, the probe segment.

A segment is a plain file under /dev/shm (tmpfs), mapped with mmap. We do not use
multiprocessing.shared_memory: on Python 3.11 every process that attaches registers the
segment with its resource tracker, which unlinks it when that process exits (and warns), so
a receiver could delete a bucket under the sender.

Cleanup is guaranteed three ways: a pool unlinks its segments on close() (and at exit); segment
names carry the creating pid, so `sweep_stale_segments()` (run by weight-sync at start) removes
what a killed predecessor left behind; and receivers (services/weights/shm.py ShmReader) only
ever map segments read-only, never own them.

The probe segment is how weight-sync proves, rather than assumes, that a receiver sees its shm
directory: it writes a fresh random nonce and asks the receiver (ProbeSharedMemory, answered by
services/weights/probe.py) to read it back.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import uuid

from looprl.inference.v1 import inference_pb2
from services.kit.process.hosts import shm_dir
from services.weights.probe import NONCE_BYTES
from services.weights.shm import PREFIX, segment_pid


class ProbeSegment:
    """A segment holding a random nonce; unlinked on close (use as a context manager)."""

    def __init__(self) -> None:
        self.nonce = os.urandom(NONCE_BYTES)
        self.segment = ShmSegment(f"{PREFIX}{os.getpid()}-probe-{uuid.uuid4().hex[:12]}", NONCE_BYTES)
        self.segment.buffer[:NONCE_BYTES] = self.nonce

    @property
    def name(self) -> str:
        return self.segment.name

    def request(self) -> inference_pb2.ProbeSharedMemoryRequest:
        return inference_pb2.ProbeSharedMemoryRequest(segment=self.name, nbytes=NONCE_BYTES)

    def close(self) -> None:
        self.segment.close()

    def __enter__(self) -> ProbeSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmSegment:
    """One writable segment owned by the process that created it."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.path = shm_dir() / name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            self._map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.buffer = memoryview(self._map)

    def close(self) -> None:
        try:
            self.buffer.release()
            self._map.close()
        except (BufferError, ValueError):
            pass  # a view is still exported; the file is unlinked below anyway
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class ShmPool:
    """A ring of reusable segments of one size: buckets are written into a free segment and the
    segment returns to the pool once every receiver of that bucket has read it. Reuse keeps
    pages mapped and warm, which is what makes the path run near memcpy speed."""

    def __init__(self, segment_bytes: int, count: int = 4, tag: str = "") -> None:
        self.segment_bytes = segment_bytes
        self._prefix = f"{PREFIX}{os.getpid()}-{tag or uuid.uuid4().hex[:8]}"
        self._segments: list[ShmSegment] = []
        self._free: list[ShmSegment] = []
        self._cond = threading.Condition()
        self._count = count
        self._made = 0
        self._closed = False
        atexit.register(self.close)

    def acquire(self, nbytes: int) -> ShmSegment:
        """A free segment of at least nbytes (blocks while all are in use)."""
        if nbytes > self.segment_bytes:
            # An oversized bucket (one huge slice) gets its own segment, freed on release.
            seg = ShmSegment(f"{self._prefix}-x{uuid.uuid4().hex[:8]}", nbytes)
            with self._cond:
                self._segments.append(seg)
            return seg
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("shared-memory pool is closed")
                if self._free:
                    return self._free.pop()
                if len([s for s in self._segments if s.size == self.segment_bytes]) < self._count:
                    seg = ShmSegment(f"{self._prefix}-{self._made}", self.segment_bytes)
                    self._made += 1
                    self._segments.append(seg)
                    return seg
                self._cond.wait()

    def release(self, seg: ShmSegment) -> None:
        with self._cond:
            if seg.size != self.segment_bytes:
                self._segments.remove(seg)
                seg.close()
            else:
                self._free.append(seg)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for seg in self._segments:
                seg.close()
            self._segments.clear()
            self._free.clear()
            self._cond.notify_all()

    def names(self) -> list[str]:
        with self._cond:
            return [s.name for s in self._segments]


def sweep_stale_segments() -> list[str]:
    """Remove segments whose creating process is gone (a weight-sync killed with -9)."""
    removed = []
    directory = shm_dir()
    for path in directory.glob(f"{PREFIX}*"):
        pid = segment_pid(path.name)
        if pid is None:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ChunkArena:
    """Where weight-sync keeps one version's pushed trainer chunks: shared-memory segments filled
    front to back as chunks arrive. Co-located receivers then read (reshard-on-read) the byte
    ranges their plan names straight out of these segments, so weight-sync never copies a bucket
    for them. Segments come from an ArenaPool and go back to it on `release()` (reused by a later
    version: receivers keep their mappings and the pages stay warm)."""

    ALIGN = 64

    def __init__(self, pool: ArenaPool) -> None:
        self.pool = pool
        self.segments: list[ShmSegment] = []
        self._used = 0  # bytes used in the last segment
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> tuple[str, int, memoryview]:
        """(segment name, byte offset, writable view) of nbytes fresh bytes."""
        with self._lock:
            seg = self.segments[-1] if self.segments else None
            start = -(-self._used // self.ALIGN) * self.ALIGN
            if seg is None or start + nbytes > seg.size:
                seg = self.pool.take(nbytes)
                self.segments.append(seg)
                start = 0
            self._used = start + nbytes
            return seg.name, start, seg.buffer[start : start + nbytes]

    def release(self) -> None:
        with self._lock:
            segments, self.segments = self.segments, []
            self._used = 0
        for seg in segments:
            self.pool.give(seg)


class ArenaPool:
    """Segments of `segment_bytes` shared by the ChunkArenas of successive versions. At most
    `keep` free segments are kept (enough for two versions of the model); the rest are unlinked."""

    def __init__(self, segment_bytes: int = 256 << 20, keep: int = 16, tag: str = "") -> None:
        self.segment_bytes = segment_bytes
        self.keep = keep
        self._prefix = f"{PREFIX}{os.getpid()}-{tag or 'arena-' + uuid.uuid4().hex[:8]}"
        self._free: list[ShmSegment] = []
        self._live: set[ShmSegment] = set()
        self._made = 0
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def arena(self) -> ChunkArena:
        return ChunkArena(self)

    def take(self, nbytes: int) -> ShmSegment:
        size = max(nbytes, self.segment_bytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("shared-memory arena pool is closed")
            for i, seg in enumerate(self._free):
                if seg.size >= size and (seg.size == self.segment_bytes or seg.size == size):
                    self._live.add(seg)
                    return self._free.pop(i)
            self._made += 1
            seg = ShmSegment(f"{self._prefix}-{self._made}", size)
            self._live.add(seg)
            return seg

    def give(self, seg: ShmSegment) -> None:
        with self._lock:
            self._live.discard(seg)
            if self._closed or seg.size != self.segment_bytes or len(self._free) >= self.keep:
                seg.close()
            else:
                self._free.append(seg)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for seg in [*self._free, *self._live]:
                seg.close()
            self._free.clear()
            self._live.clear()
