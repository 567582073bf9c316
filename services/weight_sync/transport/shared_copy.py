"""Shared staging: one copy of a receiver layout per host, served by every co-located deployment.

When several deployments on weight-sync's host need the same TP-rank parameters, copying a version
into each of them costs one memcpy of the model per deployment, and on a small host those copies
queue on the same cores and memory bus. Instead weight-sync writes the rank's parameters once into
a shared-memory copy laid out as the receiver's tensors, and every receiver adopts it (WeightSlice
shm_adopt): its staged tensors become read-only views of the copy, and it serves from them.

Verification is split, not repeated: each slice's sum64 (from the record taken when the trainer's
bytes landed and were verified, see PlannedBucket.expected_sums) is sent to one receiver, balanced by
bytes, and every receiver reads the same pages, so the copy is verified once per host. A receiver
that fails before verifying its share has it verified by weight-sync instead; a copy that fails
verification anywhere fails every receiver that adopted it, so none of them serves it.

Copies form a small ring per receiver group, reused across versions so their pages stay mapped
and warm on both sides. A copy is overwritten only when no receiver of the group serves it, holds
it as its rollback point or has it staged (asked with Status just before); when every copy is in
use and the ring is full, the caller falls back to per-receiver copies for that version.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from looprl.inference.v1 import inference_pb2
from services.weights.bucket import Bucket
from services.weights.checksum import SliceChecksum, sum64, verify_slice
from services.weights.errors import ChecksumMismatch, DeliveryError
from services.weights.specs import itemsize, torch_dtype_of

from .arena import ArenaPool, ChunkArena
from .base import Delivery, Endpoint, StageResult, StageStreams, Transport, aiter_buckets

log = logging.getLogger("looprl.weight_transfer")

GroupKey = tuple[frozenset[Endpoint], int]


@dataclass
class SharedCopy:
    """One rank's parameters, each contiguous, in shared memory; holds one version at a time."""

    arena: ChunkArena
    version: int = -1
    busy: bool = False
    regions: dict[str, tuple[str, int, memoryview]] = field(default_factory=dict)

    def region(self, name: str, nbytes: int) -> tuple[str, int, memoryview]:
        """(segment, byte offset, writable view) of the whole parameter `name`, placed on first use."""
        found = self.regions.get(name)
        if found is None:
            found = self.regions[name] = self.arena.alloc(nbytes)
        elif len(found[2]) != nbytes:
            raise DeliveryError(f"shared copy: {name} was {len(found[2])} bytes, now {nbytes}")
        return found


class SharedCopies:
    """The rings of copies of one weight-sync process, one ring per receiver group."""

    def __init__(self, *, copies_per_group: int = 3, max_groups: int = 4, segment_bytes: int = 256 << 20):
        self.copies_per_group = copies_per_group
        self.max_groups = max_groups
        self.pool = ArenaPool(segment_bytes, keep=0, tag="copy")
        self._rings: OrderedDict[GroupKey, list[SharedCopy]] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, key: GroupKey, in_use: set[int]) -> SharedCopy | None:
        """A copy no receiver of the group depends on, or None when the ring is full and busy."""
        with self._lock:
            ring = self._rings.setdefault(key, [])
            self._rings.move_to_end(key)
            while len(self._rings) > self.max_groups:  # receivers keep old pages alive by their mappings
                _, old = self._rings.popitem(last=False)
                for copy in old:
                    copy.arena.release()
            for copy in ring:
                if not copy.busy and copy.version not in in_use:
                    copy.busy = True
                    return copy
            if len(ring) >= self.copies_per_group:
                return None
            copy = SharedCopy(self.pool.arena(), busy=True)
            ring.append(copy)
            return copy

    def release(self, copy: SharedCopy, version: int) -> None:
        with self._lock:
            copy.version = version
            copy.busy = False

    def close(self) -> None:
        with self._lock:
            self._rings.clear()
        self.pool.close()


async def versions_in_use(transport: Transport, endpoints: Sequence[Endpoint]) -> set[int] | None:
    """Every version a receiver of the group serves, can roll back to or has staged; None if one
    cannot say (then nothing shared may be overwritten)."""

    async def one(ep: Endpoint) -> inference_pb2.StatusResponse | None:
        try:
            return await transport.stub(ep.address).Status(inference_pb2.StatusRequest(), timeout=10)
        except grpc.aio.AioRpcError:
            return None

    statuses = await asyncio.gather(*(one(ep) for ep in endpoints))
    known = [s for s in statuses if s is not None]
    if len(known) < len(statuses):
        return None
    return {v for s in known for v in (s.weight_version, s.rollback_version, s.staged_version) if v >= 0}


def _materialize(
    copy: SharedCopy, bucket: Bucket
) -> list[tuple[inference_pb2.WeightSlice, int, torch.Tensor]]:
    """Copy the bucket's slices into the copy; (adopt slice, expected sum64, its bytes) each."""
    expected = bucket.expected_sums()  # from the landing record; None when chunks are not in shm
    dests, places = [], []
    for ref in bucket.slices:
        dtype = torch_dtype_of(ref.dtype)
        if dtype is None:
            raise DeliveryError(f"{ref.name}: unsupported dtype enum {ref.dtype}")
        size = itemsize(dtype)
        seg, base, view = copy.region(ref.name, math.prod(ref.shape) * size)
        start = ref.offset * size
        dests.append(
            torch.frombuffer(view[start : start + ref.nbytes], dtype=torch.uint8)
            if ref.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        places.append((seg, base + start))
    bucket.copy_to(dests)
    out = []
    for i, (ref, dest, (seg, offset)) in enumerate(zip(bucket.slices, dests, places, strict=True)):
        msg = ref.weight_slice(shm_name=seg, shm_offset=offset, shm_adopt=True)
        want = expected[i] if expected is not None else sum64(dest.numpy())
        out.append((msg, want, dest))
    return out


async def stage_shared(
    transport: Transport,
    copies: SharedCopies,
    copy: SharedCopy,
    delivery: Delivery,
    endpoints: Sequence[Endpoint],
) -> dict[Endpoint, StageResult]:
    """Write every bucket of `delivery` once into `copy` (of `copies`, which takes it back at the end);
    each receiver adopts it and verifies its share."""
    loop = asyncio.get_running_loop()
    version, timeout_s = delivery.version, delivery.timeout_s
    results = {ep: StageResult(ep) for ep in endpoints}
    streams = StageStreams(transport, results, timeout_s)
    verify_load = dict.fromkeys(endpoints, 0)
    shares: dict[Endpoint, list[tuple[str, int, int, torch.Tensor]]] = {ep: [] for ep in endpoints}
    start = time.perf_counter()
    first = True

    try:
        async for bucket in aiter_buckets(delivery.buckets):
            alive = [ep for ep in endpoints if results[ep].error is None]
            if not alive:
                break
            items = await loop.run_in_executor(transport._executor, _materialize, copy, bucket)
            per_ep: dict[Endpoint, list[inference_pb2.WeightSlice]] = {ep: [] for ep in alive}
            for msg, want, dest in items:
                verifier = min(alive, key=verify_load.__getitem__)
                verify_load[verifier] += msg.nbytes
                shares[verifier].append((msg.name, msg.offset, want, dest))
                for ep in alive:
                    one = inference_pb2.WeightSlice()
                    one.CopyFrom(msg)
                    if ep == verifier:
                        one.sum64 = want
                    per_ep[ep].append(one)
            config = delivery.model_config_json if first else ""
            first = False
            await asyncio.gather(
                *(
                    streams.write(
                        ep,
                        delivery.request(bucket, per_ep[ep], model_config_json=config, endpoint=ep),
                        bucket.nbytes,
                    )
                    for ep in alive
                )
            )
        await streams.finish()
    except BaseException as exc:
        for ep, res in results.items():
            if res.error is None:
                res.error = transport._error(ep, exc)
        streams.cancel()
        await asyncio.gather(*(transport.abort(ep, version) for ep in endpoints))
        if isinstance(exc, asyncio.CancelledError):
            raise
        return results
    finally:
        copies.release(copy, version)

    log.info("version %d: one shared copy for %s", version, ", ".join(map(str, endpoints)))
    bad = next(
        (
            r.error
            for r in results.values()
            if r.error is not None and r.error.code == grpc.StatusCode.DATA_LOSS
        ),
        None,
    )
    if bad is None:  # shares of receivers that failed otherwise: weight-sync reads the same pages
        unverified = [s for ep, r in results.items() if r.error is not None for s in shares[ep]]
        for name, offset, want, dest in unverified:
            try:
                verify_slice(
                    SliceChecksum("sum64", want),
                    dest.numpy(),
                    where=name,
                    what=f"{name} elements from {offset} in the shared copy",
                )
            except ChecksumMismatch as exc:
                bad = DeliveryError(str(exc), code=grpc.StatusCode.DATA_LOSS)
                break
    for ep, res in results.items():
        res.seconds = time.perf_counter() - start
        if res.error is None and bad is not None:
            res.error = DeliveryError(
                f"{ep}: the shared copy of version {version} failed verification ({bad}); not served",
                endpoint=str(ep),
                code=grpc.StatusCode.DATA_LOSS,
            )
        elif res.error is None and not res.complete:
            res.error = DeliveryError(
                f"{ep}: version {version} incomplete after last bucket", endpoint=str(ep)
            )
    await asyncio.gather(*(transport.abort(ep, version) for ep, r in results.items() if r.error is not None))
    return results
