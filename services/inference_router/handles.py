"""How the router reaches one replica: a Ray actor (InferenceReplica) or an external gRPC server
implementing InferenceEngineService.

Both present the same small async interface (ReplicaHandle). Errors are sorted into two kinds,
because failover depends on it: a ReplicaFailure (the replica died, timed out or is overloaded:
retry elsewhere) and a kit ServiceError (the request itself is wrong: answer the caller, do not
retry).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.replica_status import ReplicaStatus
from services.kit.rpc import errors
from services.kit.telemetry import tracing as telemetry

# Engine answers that say the request is at fault: passed through to the caller, never retried.
_CALLER_FAULT = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
}


class ReplicaFailure(Exception):
    """The replica could not serve (dead, restarting, timed out, overloaded): try another one."""

    def __init__(self, replica: str, why: str, *, crashed: bool = False, overloaded: bool = False) -> None:
        super().__init__(f"replica {replica}: {why}")
        self.replica = replica
        self.why = why
        # The actor process died (Ray restarts it; it must resync before serving again).
        self.crashed = crashed
        # The replica is healthy but its own queue is full: try another, keep it in routing.
        self.overloaded = overloaded


class ReplicaHandle(Protocol):
    name: str

    async def generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> inference_pb2.GenerateResponse: ...

    def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]: ...

    async def status(self, timeout_s: float) -> ReplicaStatus: ...

    async def close(self) -> None: ...


class RayReplicaHandle:
    """An InferenceReplica actor. Unary generation goes straight to the replica's own
    InferenceEngineService server once its address is known (one gRPC hop is cheaper than a Ray
    actor call, see bench/router_overhead.py); streaming and status go through Ray, and status
    also tells the handle when a restarted replica came back on a new address."""

    def __init__(self, name: str, actor: Any, direct_grpc: bool = True, adapter: str = "") -> None:
        self.name = name
        self.actor = actor
        self.direct_grpc = direct_grpc
        # A LoRA run's view of a replica it may share: status reports the run's adapter version.
        self.adapter = adapter
        self._direct: GrpcReplicaHandle | None = None

    async def generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> inference_pb2.GenerateResponse:
        if self._direct is not None:
            return await self._direct.generate(request, timeout_s)
        raw = await self._call(
            self.actor.generate.remote(request.SerializeToString(), telemetry.current_carrier() or None),
            timeout_s,
        )
        return inference_pb2.GenerateResponse.FromString(raw)

    async def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        import ray

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            gen = self.actor.generate_stream.options(num_returns="streaming").remote(
                request.SerializeToString(), telemetry.current_carrier() or None
            )
            async for ref in gen:
                raw = await self._call(ref, max(0.01, deadline - loop.time()))
                yield inference_pb2.GenerateStreamResponse.FromString(raw)
        except ray.exceptions.RayError as exc:
            raise self._failure(exc) from exc

    async def status(self, timeout_s: float) -> ReplicaStatus:
        call = self.actor.status.remote(self.adapter) if self.adapter else self.actor.status.remote()
        status: ReplicaStatus = await self._call(call, timeout_s)
        address = status.address
        if self.direct_grpc and address and (self._direct is None or self._direct.address != address):
            old, self._direct = self._direct, GrpcReplicaHandle(self.name, address)
            if old is not None:
                await old.close()
        return status

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()
            self._direct = None

    async def _call(self, ref: Any, timeout_s: float) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except TimeoutError as exc:
            ray.cancel(ref) if isinstance(ref, ray.ObjectRef) else None
            raise ReplicaFailure(self.name, f"no answer within {timeout_s:.1f}s") from exc
        except ray.exceptions.RayError as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> Exception:
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause if hasattr(exc, "cause") else None
            if isinstance(cause, errors.ServiceError) and cause.code in _CALLER_FAULT:
                return cause
            if isinstance(cause, errors.ResourceExhausted):
                return ReplicaFailure(self.name, f"queue full: {cause.message}", overloaded=True)
            if isinstance(cause, ValueError):
                return errors.InvalidArgument(str(cause))
            return ReplicaFailure(self.name, f"task failed: {type(cause).__name__ if cause else exc}")
        crashed = isinstance(exc, ray.exceptions.RayActorError)
        return ReplicaFailure(self.name, f"{type(exc).__name__}: {exc}".splitlines()[0], crashed=crashed)


class GrpcReplicaHandle:
    """An external deployment's server (InferenceEngineService), e.g. a vLLM server with our shim."""

    def __init__(self, name: str, address: str, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        from services.kit.rpc.server import open_channel

        self.name = name
        self.address = address
        self._channel = open_channel(address, max_message_bytes)
        self._stub = inference_pb2_grpc.InferenceEngineServiceStub(self._channel)

    async def generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> inference_pb2.GenerateResponse:
        try:
            return await self._stub.Generate(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc) from exc

    async def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        # The engine contract is unary; an external replica streams one chunk per completion.
        response = await self.generate(request, timeout_s)
        for index, completion in enumerate(response.completions):
            yield inference_pb2.GenerateStreamResponse(
                index=index,
                token_ids=completion.token_ids,
                logprobs=completion.logprobs,
                weight_version=completion.weight_version,
                finish_reason=completion.finish_reason,
            )

    async def status(self, timeout_s: float) -> ReplicaStatus:
        try:
            reply = await self._stub.Status(inference_pb2.StatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc) from exc
        return ReplicaStatus.from_proto(reply, self.name, self.address)

    async def close(self) -> None:
        await self._channel.close()

    def _failure(self, exc: grpc.aio.AioRpcError) -> Exception:
        kind = _CALLER_FAULT.get(exc.code())
        if kind is not None:
            return kind(exc.details() or exc.code().name)
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ReplicaFailure(self.name, f"queue full: {exc.details()}", overloaded=True)
        return ReplicaFailure(self.name, f"{exc.code().name}: {exc.details()}")
