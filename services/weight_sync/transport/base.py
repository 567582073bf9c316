"""The transport interface and what every transport shares: endpoints, results, the control plane.

A Transport delivers the buckets of one version (a Delivery) to a group of receivers that need the
same buckets; `stage` never raises for one receiver's failure (it is reported in that receiver's
StageResult). Commit and abort are gRPC for every transport: a receiver is always an
InferenceEngineService.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.rpc import tls
from services.weights.bucket import Bucket
from services.weights.errors import DeliveryError

STAGE_METHOD = "/looprl.inference.v1.InferenceEngineService/StageWeights"

Buckets = Iterable[Bucket] | AsyncIterable[Bucket]


@dataclass(frozen=True)
class Endpoint:
    """One receiver: a TP rank of an inference replica. `host_id` is the host identity it reported
    (services/kit/process/hosts.py); which transport reaches it is weight-sync's decision, not a field."""

    address: str
    rank: int = 0
    deployment: str = ""
    host_id: str = ""
    replica: str = ""
    adapter: str = ""
    """LoRA: the adapter (a run id) the receiver stages this target's versions as; empty: its weights."""

    def __str__(self) -> str:
        replica = f"/{self.replica}" if self.replica else ""
        return f"{self.deployment or '?'}{replica}/rank{self.rank}@{self.address}"


@dataclass(frozen=True)
class Delivery:
    """What a transport delivers to a group of receivers: the buckets of one version of one TP
    rank's parameters, and what every StageWeights message of it says besides its slices."""

    version: int
    """The weight version the receivers stage (and later commit)."""
    buckets: Buckets
    """The rank's buckets, in order; read once (it may be a generator or an async iterator)."""
    total_bytes: int = 0
    """The payload bytes of all the buckets together, sent with each one; 0 when not known."""
    model_config_json: str = ""
    """The model config, sent with the first bucket only; empty when the receivers need none."""
    timeout_s: float = 600.0
    """The deadline of each StageWeights call, in seconds."""
    commit: bool = False
    """Each receiver commits the version once it holds it complete and verified
    (StageWeightsRequest.commit_when_complete): only for a lone receiver whose own check is all."""
    adapter: str = ""
    """LoRA: the adapter every StageWeights message names (StageWeightsRequest.adapter)."""

    def request(
        self, bucket: Bucket, slices, *, model_config_json: str = "", endpoint: Endpoint | None = None
    ) -> inference_pb2.StageWeightsRequest:
        """The StageWeights message that carries `slices` of `bucket`, addressed to `endpoint`'s
        rank and deployment (none: the caller addresses it)."""
        request = inference_pb2.StageWeightsRequest(
            version=self.version,
            bucket_count=bucket.count,
            bucket_index=bucket.index,
            total_bytes=self.total_bytes,
            model_config_json=model_config_json,
            slices=slices,
            commit_when_complete=self.commit,
            adapter=self.adapter,
        )
        if endpoint is not None:
            request.rank = endpoint.rank
            request.deployment = endpoint.deployment
        return request


@dataclass
class StageResult:
    endpoint: Endpoint
    bytes_sent: int = 0
    buckets: int = 0
    complete: bool = False
    serving_version: int = -1
    """The version the receiver serves by its last answer (the staged one once it committed it)."""
    seconds: float = 0.0
    error: DeliveryError | None = None

    def answered(self, response: inference_pb2.StageWeightsResponse) -> None:
        """Fold in one StageWeights answer: complete once any said so."""
        self.complete = self.complete or response.complete
        self.serving_version = max(self.serving_version, response.serving_version)


def identity(x: bytes) -> bytes:
    return x


async def aiter_buckets(buckets: Buckets) -> AsyncIterator[Bucket]:
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
            # Imported here: the transports' own code needs only torch and gRPC (tools/gpu_torch_check.py
            # runs them on a bare CUDA image), the tracing interceptors need OpenTelemetry.
            from services.kit.rpc.interceptors import client_interceptors

            ch = tls.aio_channel(address, tls.message_limits(self.max_message_bytes), client_interceptors())
            self._channels[address] = ch
        return ch

    def stub(self, address: str) -> inference_pb2_grpc.InferenceEngineServiceAsyncStub:
        return inference_pb2_grpc.InferenceEngineServiceStub(self.channel(address))

    @abstractmethod
    async def stage(self, delivery: Delivery, endpoints: Sequence[Endpoint]) -> dict[Endpoint, StageResult]:
        """Stage every bucket of `delivery` on every endpoint; never raises for one receiver's failure."""

    async def commit(self, endpoint: Endpoint, version: int, timeout_s: float = 60.0) -> int:
        try:
            resp = await self.stub(endpoint.address).CommitWeights(
                inference_pb2.CommitWeightsRequest(version=version, adapter=endpoint.adapter),
                timeout=timeout_s,
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
                inference_pb2.AbortWeightsRequest(version=version, adapter=endpoint.adapter),
                timeout=timeout_s,
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


async def call_error(call: grpc.aio.StreamUnaryCall, exc: BaseException) -> BaseException:
    """A write that fails because the receiver answered early carries no useful status (or a
    generic INTERNAL one); the call's own status says why the receiver stopped."""
    try:
        await asyncio.wait_for(call, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e
    except BaseException:
        pass
    return exc


class StageStreams:
    """One open StageWeights client stream per receiver. Buckets go down it without an answer per
    bucket (a call per bucket cost ~1 ms on both sides, as much as copying 10 MB), so the receiver
    stages bucket i while bucket i+1 is already queued. A receiver that fails has the reason in its
    StageResult and gets nothing more."""

    def __init__(self, transport: Transport, results: dict[Endpoint, StageResult], timeout_s: float) -> None:
        self.transport = transport
        self.results = results
        self.timeout_s = timeout_s
        self.calls: dict[Endpoint, grpc.aio.StreamUnaryCall] = {}

    async def write(self, ep: Endpoint, request: inference_pb2.StageWeightsRequest, nbytes: int) -> None:
        res = self.results[ep]
        if res.error is not None:
            return
        call = self.calls.get(ep)
        if call is None:
            method = self.transport.channel(ep.address).stream_unary(
                STAGE_METHOD,
                request_serializer=inference_pb2.StageWeightsRequest.SerializeToString,
                response_deserializer=inference_pb2.StageWeightsResponse.FromString,
            )
            call = self.calls[ep] = method(timeout=self.timeout_s)
        try:
            await call.write(request)
            res.bytes_sent += nbytes
            res.buckets += 1
        except BaseException as exc:
            if res.error is None:  # a failure recorded meanwhile (another call of it) keeps its reason
                res.error = self.transport._error(ep, await call_error(call, exc))

    async def finish(self) -> None:
        """Close every stream and record whether its receiver holds the version complete."""

        async def one(ep: Endpoint, call: grpc.aio.StreamUnaryCall) -> None:
            res = self.results[ep]
            if res.error is not None:
                call.cancel()
                return
            try:
                await call.done_writing()
                res.answered(await call)
            except BaseException as exc:
                res.error = self.transport._error(ep, await call_error(call, exc))

        await asyncio.gather(*(one(ep, call) for ep, call in self.calls.items()))

    def cancel(self) -> None:
        for call in self.calls.values():
            call.cancel()
