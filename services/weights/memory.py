"""Keep bucket-sized buffers in the heap of processes that move weights over gRPC.

Every gRPC bucket is a fresh ~32 MiB allocation on both ends (the encoded message on the sender,
the received bytes on the receiver). glibc serves allocations above its mmap threshold (at most
32 MiB, adjusted dynamically) with a fresh mmap and unmaps them on free, so every page of every
bucket is faulted in and zeroed again: on bench/weight_sync.py's model, a large share of a gRPC
sync's time is page faults on both ends. Raising the mmap threshold above the largest bucket (and
the trim threshold with it) lets freed buckets be reused from the heap: faults drop to a few
thousand per sync, and bench/weight_sync.py's gRPC figures rise with it.

The cost is memory kept: up to `trim_bytes` of freed heap at the top (and `top_pad_bytes` more per
heap growth) may stay resident instead of going back to the OS (a weight receiver holds two copies
of its weights anyway). It is a process-wide setting, so it is applied once, only with glibc, and
not at all when LOOPRL_WEIGHT_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger("looprl.weight_transfer")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
_applied: bool | None = None


def retain_bucket_buffers(
    mmap_threshold_bytes: int = 256 << 20, trim_bytes: int = 1 << 30, top_pad_bytes: int = 64 << 20
) -> bool:
    """Raise glibc's mmap and trim thresholds and its top pad (once per process); True if they are
    in effect. The pad matters for the sender, whose buckets are encoded in worker threads: their
    malloc arenas otherwise grow and shrink their heaps by exactly the bucket each time."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = False
        if os.environ.get("LOOPRL_WEIGHT_MALLOC_TUNING", "1") == "0":
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False  # not glibc (musl, macOS): nothing to tune
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = bool(mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold_bytes, (1 << 31) - 1)))
        ok = bool(mallopt(_M_TRIM_THRESHOLD, min(trim_bytes, (1 << 31) - 1))) and ok
        ok = bool(mallopt(_M_TOP_PAD, min(top_pad_bytes, (1 << 31) - 1))) and ok
        if not ok:
            log.warning("mallopt refused the mmap/trim thresholds; gRPC buckets will page-fault")
        _applied = ok
        return ok
