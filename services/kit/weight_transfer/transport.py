"""Transports: how a sequence of buckets reaches the receivers of one delivery group.

One small interface (`Transport.stage/commit/abort`) with two host implementations:

- GrpcTransport: a client stream of StageWeights per receiver carrying large buckets inline.
  Each bucket is assembled and encoded once (in a worker thread, `prefetch` buckets ahead of
  the network, so resharding and sending overlap) and the same wire bytes go to every
  receiver of the group.
- ShmTransport: for receivers on this host. Several receivers of one layout share one copy
  (shared_copy.py): weight-sync writes the version once, laid out as their tensors, and each
  adopts it read-only and verifies a share of it. A single receiver: when the bucket's source
  bytes already live in
  shared memory (weight-sync keeps pushed trainer chunks in a ChunkArena), nothing is copied on
  the sending side: every receiver gets one StageWeights stream whose messages name rectangles
  of those chunks (reshard-on-read) with a sum64 each, and copies them into its staging tensors
  itself.
  Otherwise (a dtype cast on the way, chunks not in shared memory) each bucket is assembled ONCE
  into a pooled segment that all receivers read; a segment is reused once all answered.

The interface and the gRPC control plane are in transport_base.py; device transports (CUDA IPC,
NCCL) live in gpu.py behind the same interface. A failing receiver never stops the others of its
group: it is dropped, aborted and reported in the per-endpoint results.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from looprl.inference.v1 import inference_pb2

from .bucket import Bucket
from .errors import DeliveryError
from .memory import retain_bucket_buffers
from .shared_copy import SharedCopies, stage_shared, versions_in_use
from .shm import ShmPool
from .transport_base import (
    STAGE_METHOD,
    Endpoint,
    StageResult,
    StageStreams,
    Transport,
    aiter_buckets,
    call_error,
    identity,
)
from .wire import encode_stage_request

__all__ = ["Endpoint", "GrpcTransport", "ShmTransport", "StageResult", "Transport"]


@dataclass
class _Stream:
    endpoint: Endpoint
    call: grpc.aio.StreamUnaryCall
    result: StageResult
    alive: bool = True
    start: float = field(default_factory=time.perf_counter)


class GrpcTransport(Transport):
    """Buckets inline in a client stream of StageWeights, one stream per receiver."""

    name = "grpc"

    def __init__(self, *, prefetch: int = 2, **kw) -> None:
        super().__init__(**kw)
        self.prefetch = max(1, prefetch)
        retain_bucket_buffers()  # encoded buckets reuse heap pages instead of faulting (memory.py)

    async def stage(
        self, version, endpoints, buckets, *, model_config_json="", total_bytes=0, timeout_s=600.0
    ):
        loop = asyncio.get_running_loop()
        streams: list[_Stream] = []
        for ep in endpoints:
            method = self.channel(ep.address).stream_unary(
                STAGE_METHOD,
                request_serializer=identity,
                response_deserializer=inference_pb2.StageWeightsResponse.FromString,
            )
            streams.append(_Stream(ep, method(timeout=timeout_s), StageResult(ep)))
        ranks = sorted({s.endpoint.rank for s in streams})
        buffers: collections.deque[np.ndarray] = collections.deque()
        pending: collections.deque[asyncio.Future] = collections.deque()
        first = True

        def build(bucket: Bucket, config_json: str) -> tuple[Bucket, dict[int, bytes]]:
            buf = buffers.popleft() if buffers and buffers[0].nbytes >= bucket.nbytes else None
            if buf is None:
                buf = np.empty(bucket.nbytes, np.uint8)
            view = memoryview(buf)[: bucket.nbytes]
            parts = bucket.payload_parts(view)  # slices that already sit contiguous are not copied twice
            if parts is None:
                bucket.fill(view)
            wire = {
                r: encode_stage_request(
                    bucket,
                    view,
                    version=version,
                    rank=r,
                    model_config_json=config_json,
                    total_bytes=total_bytes,
                    slice_data=parts,
                )
                for r in ranks
            }
            buffers.append(buf)
            return bucket, wire

        async def send(item: tuple[Bucket, dict[int, bytes]]) -> None:
            bucket, wire = item

            async def one(s: _Stream) -> None:
                try:
                    await s.call.write(wire[s.endpoint.rank])
                    s.result.bytes_sent += bucket.nbytes
                    s.result.buckets += 1
                except BaseException as exc:
                    s.alive = False
                    s.result.error = self._error(s.endpoint, await call_error(s.call, exc))

            await asyncio.gather(*(one(s) for s in streams if s.alive))

        try:
            async for bucket in aiter_buckets(buckets):
                if not any(s.alive for s in streams):
                    break
                pending.append(
                    loop.run_in_executor(self._executor, build, bucket, model_config_json if first else "")
                )
                first = False
                if len(pending) > self.prefetch:
                    await send(await pending.popleft())
            while pending:
                await send(await pending.popleft())
        except BaseException as exc:
            for s in streams:
                s.call.cancel()
                if s.result.error is None:
                    s.result.error = self._error(s.endpoint, exc)
            for fut in pending:
                fut.cancel()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return {s.endpoint: s.result for s in streams}
        for s in streams:
            if not s.alive:
                s.call.cancel()
                continue
            try:
                await s.call.done_writing()
                resp = await s.call
                s.result.complete = resp.complete
                if not resp.complete:
                    s.result.error = DeliveryError(
                        f"{s.endpoint}: version {version} incomplete after last bucket",
                        endpoint=str(s.endpoint),
                    )
            except BaseException as exc:
                s.result.error = self._error(s.endpoint, await call_error(s.call, exc))
            s.result.seconds = time.perf_counter() - s.start
        await _abort_failed(self, version, streams)
        return {s.endpoint: s.result for s in streams}


async def _abort_failed(transport: Transport, version: int, streams: Sequence[_Stream]) -> None:
    await asyncio.gather(
        *(transport.abort(s.endpoint, version) for s in streams if s.result.error is not None)
    )


class ShmTransport(Transport):
    """Buckets written once into shared memory; co-located receivers read their slices."""

    name = "shm"

    def __init__(
        self,
        *,
        segment_bytes: int = 64 * 1024 * 1024,
        segments: int = 3,
        in_place: bool = True,
        share_min_receivers: int = 2,
        shared_copies: int = 3,
        **kw,
    ) -> None:
        if share_min_receivers < 0 or shared_copies < 1:
            raise ValueError(
                f"shared_copy_min_receivers must be >= 0 (got {share_min_receivers}) and shared_copies "
                f">= 1 (got {shared_copies})"
            )
        super().__init__(**kw)
        self.pool = ShmPool(segment_bytes, segments)
        self.in_place = in_place  # read buckets in place when they can (reshard-on-read)
        self.inflight_buckets = segments
        self.share_min_receivers = share_min_receivers  # 0 turns shared copies off
        self.shared = SharedCopies(copies_per_group=shared_copies)

    async def stage(
        self, version, endpoints, buckets, *, model_config_json="", total_bytes=0, timeout_s=600.0
    ):
        buckets = aiter_buckets(buckets)
        if self.share_min_receivers and len(endpoints) >= self.share_min_receivers:
            first = await anext(buckets, None)
            buckets = _prepend(first, buckets)
            if first is not None and first.shareable:
                in_use = await versions_in_use(self, endpoints)
                copy = (
                    None
                    if in_use is None
                    else self.shared.acquire((frozenset(endpoints), total_bytes), in_use)
                )
                if copy is not None:
                    return await stage_shared(
                        self, copy, version, endpoints, buckets,
                        model_config_json=model_config_json, total_bytes=total_bytes, timeout_s=timeout_s,
                    )  # fmt: skip
        return await self._stage_each(version, endpoints, buckets, model_config_json, total_bytes, timeout_s)

    async def _stage_each(self, version, endpoints, buckets, model_config_json, total_bytes, timeout_s):
        """Every receiver copies its slices itself (from the chunks in place, or a pooled bucket)."""
        loop = asyncio.get_running_loop()
        results = {ep: StageResult(ep) for ep in endpoints}
        starts = time.perf_counter()
        inflight: set[asyncio.Task] = set()
        streams = StageStreams(self, results, timeout_s)
        first = True

        def request(
            ep: Endpoint, bucket: Bucket, slices, config_json: str
        ) -> inference_pb2.StageWeightsRequest:
            return inference_pb2.StageWeightsRequest(
                version=version,
                bucket_count=bucket.count,
                bucket_index=bucket.index,
                rank=ep.rank,
                deployment=ep.deployment,
                total_bytes=total_bytes,
                model_config_json=config_json,
                slices=slices,
            )

        async def stream_in_place(bucket: Bucket, slices, config_json: str) -> None:
            """In-place buckets hold no segment, so they need no per-bucket answer: they go down
            one open stream per receiver."""
            await asyncio.gather(
                *(
                    streams.write(ep, request(ep, bucket, slices, config_json), bucket.nbytes)
                    for ep in endpoints
                )
            )

        async def deliver(bucket: Bucket, seg, slices, config_json: str) -> None:
            try:

                async def one(ep: Endpoint) -> None:
                    res = results[ep]
                    if res.error is not None:
                        return
                    try:
                        resp = await self.stub(ep.address).StageWeights(
                            iter([request(ep, bucket, slices, config_json)]), timeout=timeout_s
                        )
                        res.bytes_sent += bucket.nbytes
                        res.buckets += 1
                        res.complete = res.complete or resp.complete
                    except BaseException as exc:
                        if res.error is None:  # a cancelled call keeps the reason it was cancelled for
                            res.error = self._error(ep, exc)

                await asyncio.gather(*(one(ep) for ep in endpoints))
            finally:
                if seg is not None:
                    self.pool.release(seg)

        try:
            async for bucket in aiter_buckets(buckets):
                if all(r.error is not None for r in results.values()):
                    break
                seg = slices = None
                if self.in_place:
                    slices = await loop.run_in_executor(self._executor, bucket.shm_slices)
                    if slices is not None:
                        await stream_in_place(bucket, slices, model_config_json if first else "")
                        first = False
                        continue
                while len(inflight) >= self.inflight_buckets:
                    await asyncio.wait(set(inflight), return_when=asyncio.FIRST_COMPLETED)
                seg = await loop.run_in_executor(self._executor, self.pool.acquire, bucket.nbytes)
                try:
                    await loop.run_in_executor(self._executor, bucket.fill, seg.buffer[: bucket.nbytes])
                except BaseException:
                    self.pool.release(seg)
                    raise
                slices = [s.to_proto(shm_name=seg.name) for s in bucket.slices]
                task = asyncio.create_task(deliver(bucket, seg, slices, model_config_json if first else ""))
                first = False
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            if inflight:
                await asyncio.gather(*inflight)
            await streams.finish()
        except BaseException as exc:
            for ep, res in results.items():
                if res.error is None:
                    res.error = self._error(ep, exc)
            for t in inflight:
                t.cancel()
            streams.cancel()
            await asyncio.gather(*(self.abort(ep, version) for ep in endpoints))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return results
        for ep, res in results.items():
            res.seconds = time.perf_counter() - starts
            if res.error is None and not res.complete:
                res.error = DeliveryError(
                    f"{ep}: version {version} incomplete after last bucket", endpoint=str(ep)
                )
        await asyncio.gather(*(self.abort(ep, version) for ep, r in results.items() if r.error is not None))
        return results

    async def close(self) -> None:
        await super().close()
        self.pool.close()
        self.shared.close()


async def _prepend(first, rest):
    if first is not None:
        yield first
    async for item in rest:
        yield item
