"""Transports: how a sequence of buckets reaches the receivers of one delivery group.

One small interface (`Transport.stage/commit/abort`) with two host implementations:

- GrpcTransport: a client stream of StageWeights per receiver carrying large buckets inline.
  Each bucket is assembled and encoded once (in a worker thread, `prefetch` buckets ahead of
  the network, so resharding and sending overlap) and the same wire bytes go to every
  receiver of the group.
- ShmTransport: for receivers on this host. When the bucket's source bytes already live in
  shared memory (weight-sync keeps pushed trainer chunks in a ChunkArena), nothing is copied on
  the sending side: every receiver gets one StageWeights stream whose messages name rectangles
  of those chunks (reshard-on-read) with a sum64 each, and copies them into its staging tensors
  itself.
  Otherwise (a dtype cast on the way, chunks not in shared memory) each bucket is assembled ONCE
  into a pooled segment that all receivers read; a segment is reused once all answered.

The control plane (commit, abort) is gRPC for every transport: a receiver is always an
InferenceEngineService. Device transports (CUDA IPC, NCCL) live in gpu.py behind the same
interface. A failing receiver never stops the others of its group: it is dropped, aborted
and reported in the per-endpoint results.
"""

from __future__ import annotations

import asyncio
import collections
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc

from .bucket import Bucket
from .errors import DeliveryError
from .memory import retain_bucket_buffers
from .shm import ShmPool
from .wire import encode_stage_request

_STAGE = "/looprl.inference.v1.InferenceEngineService/StageWeights"


@dataclass(frozen=True)
class Endpoint:
    """One receiver: a TP rank of an inference replica."""

    address: str
    rank: int = 0
    deployment: str = ""
    same_host: bool = False
    replica: str = ""

    def __str__(self) -> str:
        replica = f"/{self.replica}" if self.replica else ""
        return f"{self.deployment or '?'}{replica}/rank{self.rank}@{self.address}"


@dataclass
class StageResult:
    endpoint: Endpoint
    bytes_sent: int = 0
    buckets: int = 0
    complete: bool = False
    seconds: float = 0.0
    error: DeliveryError | None = None


def _identity(x: bytes) -> bytes:
    return x


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


async def _aiter(buckets: Iterable[Bucket] | AsyncIterable[Bucket]):
    if isinstance(buckets, AsyncIterable):
        async for b in buckets:
            yield b
    else:
        for b in buckets:
            yield b


class Transport(ABC):
    """Delivers buckets of one version to a group of receivers that need the same buckets."""

    name = "abstract"

    def __init__(self, *, max_message_bytes: int = 256 * 1024 * 1024, workers: int = 2) -> None:
        self.max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"wt-{self.name}")

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=channel_options(self.max_message_bytes))
            self._channels[address] = ch
        return ch

    def stub(self, address: str) -> inference_pb2_grpc.InferenceEngineServiceStub:
        return inference_pb2_grpc.InferenceEngineServiceStub(self.channel(address))

    @abstractmethod
    async def stage(
        self,
        version: int,
        endpoints: Sequence[Endpoint],
        buckets: Iterable[Bucket] | AsyncIterable[Bucket],
        *,
        model_config_json: str = "",
        total_bytes: int = 0,
        timeout_s: float = 600.0,
    ) -> dict[Endpoint, StageResult]:
        """Stage every bucket on every endpoint; never raises for one receiver's failure."""

    async def commit(self, endpoint: Endpoint, version: int, timeout_s: float = 60.0) -> int:
        try:
            resp = await self.stub(endpoint.address).CommitWeights(
                inference_pb2.CommitWeightsRequest(version=version), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise DeliveryError(
                f"{endpoint}: commit of {version} failed: {e.details()}",
                endpoint=str(endpoint),
                code=e.code(),
            ) from None
        return resp.weight_version

    async def abort(self, endpoint: Endpoint, version: int, timeout_s: float = 10.0) -> bool:
        """Best effort: the receiver also aborts by itself when a stream breaks."""
        try:
            await self.stub(endpoint.address).AbortWeights(
                inference_pb2.AbortWeightsRequest(version=version), timeout=timeout_s
            )
            return True
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _error(self, endpoint: Endpoint, exc: BaseException) -> DeliveryError:
        if isinstance(exc, grpc.aio.AioRpcError):
            return DeliveryError(
                f"{endpoint}: {exc.code().name}: {exc.details()}", endpoint=str(endpoint), code=exc.code()
            )
        if isinstance(exc, DeliveryError):
            return exc
        return DeliveryError(f"{endpoint}: {type(exc).__name__}: {exc}", endpoint=str(endpoint))


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
                _STAGE,
                request_serializer=_identity,
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
            payload_parts = getattr(bucket, "payload_parts", None)
            if payload_parts is not None:  # slices that already sit contiguous are not copied twice
                parts = payload_parts(view)
            else:
                bucket.fill(view)
                parts = None
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
                    s.result.error = self._error(s.endpoint, await _call_error(s.call, exc))

            await asyncio.gather(*(one(s) for s in streams if s.alive))

        try:
            async for bucket in _aiter(buckets):
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
                s.result.error = self._error(s.endpoint, await _call_error(s.call, exc))
            s.result.seconds = time.perf_counter() - s.start
        await _abort_failed(self, version, streams)
        return {s.endpoint: s.result for s in streams}


async def _call_error(call: grpc.aio.StreamUnaryCall, exc: BaseException) -> BaseException:
    """A write that fails because the receiver answered early carries no useful status (or a
    generic INTERNAL one); the call's own status says why the receiver stopped."""
    try:
        await asyncio.wait_for(call, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e
    except BaseException:
        pass
    return exc


async def _abort_failed(transport: Transport, version: int, streams: Sequence[_Stream]) -> None:
    await asyncio.gather(
        *(transport.abort(s.endpoint, version) for s in streams if s.result.error is not None)
    )


class ShmTransport(Transport):
    """Buckets written once into shared memory; co-located receivers read their slices."""

    name = "shm"

    def __init__(
        self, *, segment_bytes: int = 64 * 1024 * 1024, segments: int = 3, in_place: bool = True, **kw
    ) -> None:
        super().__init__(**kw)
        self.pool = ShmPool(segment_bytes, segments)
        self.in_place = in_place  # read buckets in place when they can (reshard-on-read)
        self.inflight_buckets = segments

    async def stage(
        self, version, endpoints, buckets, *, model_config_json="", total_bytes=0, timeout_s=600.0
    ):
        loop = asyncio.get_running_loop()
        results = {ep: StageResult(ep) for ep in endpoints}
        starts = time.perf_counter()
        inflight: set[asyncio.Task] = set()
        streams: dict[Endpoint, grpc.aio.StreamUnaryCall] = {}
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
            """In-place buckets hold no segment, so they need no per-bucket answer: they go down one
            open stream per receiver (a call per bucket cost ~1 ms each on both sides, as much as
            copying 10 MB), and the receiver copies bucket i while bucket i+1 is already queued."""

            async def one(ep: Endpoint) -> None:
                res = results[ep]
                if res.error is not None:
                    return
                call = streams.get(ep)
                if call is None:
                    method = self.channel(ep.address).stream_unary(
                        _STAGE,
                        request_serializer=inference_pb2.StageWeightsRequest.SerializeToString,
                        response_deserializer=inference_pb2.StageWeightsResponse.FromString,
                    )
                    call = streams[ep] = method(timeout=timeout_s)
                try:
                    await call.write(request(ep, bucket, slices, config_json))
                    res.bytes_sent += bucket.nbytes
                    res.buckets += 1
                except BaseException as exc:
                    if res.error is None:
                        res.error = self._error(ep, await _call_error(call, exc))

            await asyncio.gather(*(one(ep) for ep in endpoints))

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

        async def finish_streams() -> None:
            async def one(ep: Endpoint, call: grpc.aio.StreamUnaryCall) -> None:
                res = results[ep]
                if res.error is not None:
                    call.cancel()
                    return
                try:
                    await call.done_writing()
                    resp = await call
                    res.complete = res.complete or resp.complete
                except BaseException as exc:
                    res.error = self._error(ep, await _call_error(call, exc))

            await asyncio.gather(*(one(ep, call) for ep, call in streams.items()))

        try:
            async for bucket in _aiter(buckets):
                if all(r.error is not None for r in results.values()):
                    break
                seg = slices = None
                in_place = getattr(bucket, "shm_slices", None) if self.in_place else None
                if in_place is not None:
                    slices = await loop.run_in_executor(self._executor, in_place)
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
            await finish_streams()
        except BaseException as exc:
            for ep, res in results.items():
                if res.error is None:
                    res.error = self._error(ep, exc)
            for t in inflight:
                t.cancel()
            for call in streams.values():
                call.cancel()
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
