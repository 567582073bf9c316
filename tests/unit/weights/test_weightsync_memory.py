"""Bucket-sized buffers freed by a weight transfer are reused from the heap, not faulted in again
(every page of a fresh 32 MiB mmap is faulted and zeroed: a third of a gRPC sync's time)."""

from __future__ import annotations

import resource
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.weights.memory import retain_bucket_buffers

BUCKET = 33 << 20  # above glibc's largest default mmap threshold (32 MiB)
PAGES = BUCKET // 4096


def _faults_over_cycles(cycles: int = 5) -> int:
    def one() -> int:
        payload = b"\x01" * BUCKET  # malloc + touch every page, like an encoded or received bucket
        return len(payload)

    one()  # the first one may fault: the heap has to grow once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        one()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_bucket_buffers_are_reused_without_page_faults():
    if not retain_bucket_buffers():
        pytest.skip("not glibc: nothing to tune")
    assert retain_bucket_buffers()  # idempotent
    assert _faults_over_cycles() < PAGES  # untuned: ~PAGES faults per cycle
    with ThreadPoolExecutor(1) as pool:  # senders encode buckets in worker threads (other arenas)
        assert pool.submit(_faults_over_cycles).result() < PAGES
