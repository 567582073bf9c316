"""The weight RPCs of InferenceEngineService on top of a WeightStager.

An inference replica delegates StageWeights / CommitWeights / AbortWeights here and gets
verification, error statuses and abort-on-broken-stream for free; it only supplies what to do
with a committed state dict (swap it in). `WeightServicer` is the servicer half of that wiring, for
an engine to subclass. `WeightOnlyEngine` is a complete InferenceEngineService that holds weights
and serves nothing else: the receiver weight-sync tests and benchmarks talk to, and a reference
for engine authors.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import grpc
import torch

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.process.hosts import host_identity
from services.kit.rpc import tls
from services.kit.rpc.errors import ServiceError
from services.kit.rpc.raw_requests import add_with_raw_requests

from .errors import WeightTransferError
from .memory import retain_bucket_buffers
from .probe import read_probe
from .shm import ShmReader
from .stager import StageProgress, WeightStager
from .wire import DecodedStageRequest, decode_stage_request

CommitHook = Callable[[int, dict[str, torch.Tensor]], Awaitable[None] | None]


class WeightReceiver:
    """Weight RPC handlers for one replica rank."""

    def __init__(self, stager: WeightStager, on_commit: CommitHook | None = None) -> None:
        self.stager = stager
        self.on_commit = on_commit
        self.nccl_group = None  # set by a GPU engine that joined weight-sync's NCCL group
        self.bytes_received = 0  # payload bytes accepted, all versions (for accounting)
        self.shm_bytes_received = 0  # of which read from shared memory
        self.buckets_received = 0
        self._lock = threading.Lock()
        self._shm = ShmReader()  # kept open: weight-sync reuses its segments (see ShmReader)
        retain_bucket_buffers()  # received buckets reuse heap pages instead of faulting (memory.py)

    async def StageWeights(
        self,
        request_iterator: AsyncIterator[inference_pb2.StageWeightsRequest | bytes],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.StageWeightsResponse:
        """Requests are parsed messages, or raw bytes when the method is registered by
        `add_engine_servicer` (decoded here without copying their payload)."""
        version: int | None = None
        commit = False
        progress: StageProgress | None = None
        finished = False
        try:
            self._shm.refresh()
            async for raw in request_iterator:
                request = decode_stage_request(raw) if isinstance(raw, bytes) else raw
                version, commit = request.version, request.commit_when_complete
                progress = await asyncio.to_thread(self._stage, request, self._shm)
            finished = True
            if commit and version is not None and progress is not None and progress.complete:
                await self._commit(version)
        except (ServiceError, WeightTransferError) as exc:
            # Read the rest of the stream before answering: a sender still writing into a call the
            # server already closed gets a generic INTERNAL from gRPC instead of this status.
            async for _ in request_iterator:
                pass
            await context.abort(exc.code, str(exc))
        finally:
            if not finished and version is not None and version != self.stager.serving_version:
                # The stream broke (sender died, cancelled): never keep half a version around.
                self.stager.abort(version)
        if version is None or progress is None:
            return inference_pb2.StageWeightsResponse(serving_version=self.stager.serving_version)
        return inference_pb2.StageWeightsResponse(
            version=version,
            bytes_received=progress.bytes_received,
            complete=progress.complete,
            serving_version=self.stager.serving_version,
        )

    def _stage(
        self, request: inference_pb2.StageWeightsRequest | DecodedStageRequest, reader: ShmReader
    ) -> StageProgress:
        if request.device_handle or request.nccl_broadcast:
            from .device import stage_device_request

            progress = stage_device_request(self.stager, request, nccl_group=self.nccl_group)
        else:
            progress = self.stager.stage(request, reader)
        with self._lock:
            self.bytes_received += sum(s.nbytes or len(s.data) for s in request.slices)
            self.shm_bytes_received += sum(s.nbytes for s in request.slices if s.shm_name)
            self.buckets_received += 1
        return progress

    async def CommitWeights(
        self, request: inference_pb2.CommitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CommitWeightsResponse:
        if request.version == self.stager.serving_version and self.stager.staged_version is None:
            return inference_pb2.CommitWeightsResponse(weight_version=request.version)  # a retried commit
        try:
            await self._commit(request.version)
        except (ServiceError, WeightTransferError) as exc:
            await context.abort(exc.code, str(exc))
        return inference_pb2.CommitWeightsResponse(weight_version=self.stager.serving_version)

    async def _commit(self, version: int) -> None:
        state = self.stager.commit(version)
        if self.on_commit is not None:
            result = self.on_commit(version, state)
            if inspect.isawaitable(result):
                await result

    async def AbortWeights(
        self, request: inference_pb2.AbortWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.AbortWeightsResponse:
        self.stager.abort(request.version or None)
        return inference_pb2.AbortWeightsResponse()

    async def RollbackWeights(
        self, request: inference_pb2.RollbackWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.RollbackWeightsResponse:
        """Serve the version before `request.version` again (a canary that failed its check);
        the swap goes through the same hook as a commit."""
        try:
            previous, state = self.stager.rollback(request.version)
        except (ServiceError, WeightTransferError) as exc:
            await context.abort(exc.code, str(exc))
        if self.on_commit is not None:
            result = self.on_commit(previous, state)
            if inspect.isawaitable(result):
                await result
        return inference_pb2.RollbackWeightsResponse(weight_version=self.stager.serving_version)

    async def ProbeSharedMemory(
        self, request: inference_pb2.ProbeSharedMemoryRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ProbeSharedMemoryResponse:
        """Read back weight-sync's probe segment (probe.py): how it learns shared memory reaches us."""
        try:
            return read_probe(request)
        except ServiceError as exc:
            await context.abort(exc.code, str(exc))


class WeightServicer(inference_pb2_grpc.InferenceEngineServiceServicer):
    """An InferenceEngineService whose weight RPCs `self.receiver` (a WeightReceiver) answers; an
    engine subclasses it, sets `receiver` and adds what it serves (Generate, Status...)."""

    receiver: WeightReceiver

    async def StageWeights(self, request_iterator, context):
        return await self.receiver.StageWeights(request_iterator, context)

    async def CommitWeights(self, request, context):
        return await self.receiver.CommitWeights(request, context)

    async def AbortWeights(self, request, context):
        return await self.receiver.AbortWeights(request, context)

    async def RollbackWeights(self, request, context):
        return await self.receiver.RollbackWeights(request, context)

    async def ProbeSharedMemory(self, request, context):
        return await self.receiver.ProbeSharedMemory(request, context)


class WeightOnlyEngine(WeightServicer):
    """An InferenceEngineService that only holds weights (tests, benchmarks, reference)."""

    def __init__(self, stager: WeightStager, *, keep: bool = True) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.commits: list[int] = []
        self._keep = keep
        self.receiver = WeightReceiver(stager, self._swap)

    @property
    def stager(self) -> WeightStager:
        return self.receiver.stager

    @property
    def version(self) -> int:
        return self.stager.serving_version

    def _swap(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        old, self.weights = self.weights, dict(state) if self._keep else {}
        self.commits.append(version)
        if self._keep:
            self.stager.give_back(old)  # the rollback point, then the next staging buffers
        else:
            self.stager.recycle(state)

    async def Status(self, request, context):
        staged, previous = self.stager.staged_version, self.stager.rollback_version
        return inference_pb2.StatusResponse(
            weight_version=self.version,
            staged_version=-1 if staged is None else staged,
            rollback_version=-1 if previous is None else previous,
            host_id=host_identity(),
        )


async def serve_engine(
    engine: inference_pb2_grpc.InferenceEngineServiceServicer,
    port: int = 0,
    max_message_bytes: int = 256 * 1024 * 1024,
    host: str = "127.0.0.1",
) -> tuple[grpc.aio.Server, str]:
    """Start a gRPC server for an engine on `host` (an address of this host others reach it at);
    returns (server, address)."""
    server = grpc.aio.server(options=tls.message_limits(max_message_bytes))
    add_engine_servicer(server, engine)
    bound = tls.add_port(server, f"{host}:{port}")
    await server.start()
    return server, f"{host}:{bound}"


def add_engine_servicer(server, servicer: inference_pb2_grpc.InferenceEngineServiceServicer) -> None:
    """Like `add_InferenceEngineServiceServicer_to_server`, but StageWeights receives raw request
    bytes (its handler must accept them, as WeightReceiver does) so a bucket's payload is never
    copied by protobuf: the difference between ~3 copies of every byte and one."""
    add_with_raw_requests(
        server, inference_pb2_grpc.add_InferenceEngineServiceServicer_to_server, servicer, ["StageWeights"]
    )
