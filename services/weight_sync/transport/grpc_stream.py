"""GrpcTransport: buckets inline in a client stream of StageWeights, one stream per receiver.

Each bucket is assembled and encoded once (in a worker thread, `prefetch` buckets ahead of the
network, so resharding and sending overlap) and the same wire bytes go to every receiver of the
group. A failing receiver never stops the others of its group: it is dropped, aborted and
reported in the per-endpoint results.
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
from services.weights.bucket import Bucket
from services.weights.errors import DeliveryError
from services.weights.memory import retain_bucket_buffers
from services.weights.wire import encode_stage_request

from .base import (
    STAGE_METHOD,
    Delivery,
    Endpoint,
    StageResult,
    Transport,
    aiter_buckets,
    call_error,
    identity,
)


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

    async def stage(self, delivery: Delivery, endpoints: Sequence[Endpoint]) -> dict[Endpoint, StageResult]:
        version, total_bytes = delivery.version, delivery.total_bytes
        loop = asyncio.get_running_loop()
        streams: list[_Stream] = []
        for ep in endpoints:
            method = self.channel(ep.address).stream_unary(
                STAGE_METHOD,
                request_serializer=identity,
                response_deserializer=inference_pb2.StageWeightsResponse.FromString,
            )
            streams.append(_Stream(ep, method(timeout=delivery.timeout_s), StageResult(ep)))
        ranks = sorted({s.endpoint.rank for s in streams})
        buffers: collections.deque[np.ndarray] = collections.deque()
        pending: collections.deque[asyncio.Future] = collections.deque()
        first = True

        def build(bucket: Bucket, config_json: str) -> tuple[Bucket, dict[int, bytes]]:
            buf = buffers.popleft() if buffers and buffers[0].nbytes >= bucket.nbytes else None
            if buf is None:
                buf = np.empty(bucket.nbytes, np.uint8)
            view = buf.data[: bucket.nbytes]
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
                    commit_when_complete=delivery.commit,
                    adapter=delivery.adapter,
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
            async for bucket in aiter_buckets(delivery.buckets):
                if not any(s.alive for s in streams):
                    break
                pending.append(
                    loop.run_in_executor(
                        self._executor, build, bucket, delivery.model_config_json if first else ""
                    )
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
                s.result.answered(resp)
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
