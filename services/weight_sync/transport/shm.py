"""ShmTransport: buckets for receivers on weight-sync's host, through shared memory.

Several receivers of one layout share one copy (shared_copy.py): weight-sync writes the version
once, laid out as their tensors, and each adopts it read-only and verifies a share of it. A single
receiver: when the bucket's source bytes already live in shared memory (weight-sync keeps pushed
trainer chunks in a ChunkArena), nothing is copied on the sending side: every receiver gets one
StageWeights stream whose messages name rectangles of those chunks (reshard-on-read) with a sum64
each, and copies them into its staging tensors itself. Otherwise (a dtype cast on the way, chunks
not in shared memory) each bucket is assembled ONCE into a pooled segment that all receivers read;
a segment is reused once all answered. A failing receiver never stops the others of its group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from looprl.inference.v1 import inference_pb2
from services.weights.bucket import Bucket
from services.weights.errors import DeliveryError

from .arena import ShmPool
from .base import Delivery, Endpoint, StageResult, StageStreams, Transport, aiter_buckets
from .shared_copy import SharedCopies, stage_shared, versions_in_use


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

    async def stage(self, delivery: Delivery, endpoints: Sequence[Endpoint]) -> dict[Endpoint, StageResult]:
        buckets = aiter_buckets(delivery.buckets)
        if self.share_min_receivers and len(endpoints) >= self.share_min_receivers:
            first = await anext(buckets, None)
            buckets = _prepend(first, buckets)
            if first is not None and first.shareable:
                in_use = await versions_in_use(self, endpoints)
                copy = (
                    None
                    if in_use is None
                    else self.shared.acquire((frozenset(endpoints), delivery.total_bytes), in_use)
                )
                if copy is not None:
                    return await stage_shared(
                        self, self.shared, copy, replace(delivery, buckets=buckets), endpoints
                    )
        return await self._stage_each(replace(delivery, buckets=buckets), endpoints)

    async def _stage_each(
        self, delivery: Delivery, endpoints: Sequence[Endpoint]
    ) -> dict[Endpoint, StageResult]:
        """Every receiver copies its slices itself (from the chunks in place, or a pooled bucket)."""
        loop = asyncio.get_running_loop()
        version, timeout_s = delivery.version, delivery.timeout_s
        results = {ep: StageResult(ep) for ep in endpoints}
        starts = time.perf_counter()
        inflight: set[asyncio.Task] = set()
        streams = StageStreams(self, results, timeout_s)
        first = True

        def request(
            ep: Endpoint, bucket: Bucket, slices, config_json: str
        ) -> inference_pb2.StageWeightsRequest:
            return delivery.request(bucket, slices, model_config_json=config_json, endpoint=ep)

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
                        res.answered(resp)
                    except BaseException as exc:
                        if res.error is None:  # a cancelled call keeps the reason it was cancelled for
                            res.error = self._error(ep, exc)

                await asyncio.gather(*(one(ep) for ep in endpoints))
            finally:
                if seg is not None:
                    self.pool.release(seg)

        try:
            async for bucket in aiter_buckets(delivery.buckets):
                if all(r.error is not None for r in results.values()):
                    break
                seg = slices = None
                if self.in_place:
                    slices = await loop.run_in_executor(self._executor, bucket.shm_slices)
                    if slices is not None:
                        await stream_in_place(bucket, slices, delivery.model_config_json if first else "")
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
                task = asyncio.create_task(
                    deliver(bucket, seg, slices, delivery.model_config_json if first else "")
                )
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
