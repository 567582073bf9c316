"""Deliberately broken variants of looprl's services, for showing that the conformance kit catches
a broken promise and names it: a proxy in front of the real service that forwards every call as is
(same caller identity, same deadline) except one RPC, which it breaks in one way.

Each mutation below breaks one promise of one contract, the way a faulty implementation would:
a reward that answers NaN, an engine or weight-sync that takes a corrupt slice as verified, a router
that serves older weights than asked for, a sandbox that answers a session it never started, a packer
that acknowledges a step's rollouts twice, a trainer that reports a run it does not hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from conformance.served import expected_service
from looprl.inference.v1 import inference_pb2
from looprl.packer.v1 import packer_pb2
from looprl.reward.v1 import reward_pb2
from looprl.trainer.v1 import trainer_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.rpc import tls
from services.weights.checksum import hash64

# (request or request iterator, forward) -> response bytes (or an iterator of them)
Handler = Callable[[Any, Callable[[Any], Any]], Any]


@dataclass
class Mutation:
    service: str
    """Full name of the gRPC service the mutation breaks."""
    method: str
    breaks: str
    """The case of the conformance kit that must fail (and only it)."""
    handler: Handler
    state: dict[str, Any] = field(default_factory=dict)


def _nan_scores(request: bytes, forward) -> bytes:
    reply = reward_pb2.ScoreResponse.FromString(forward(request))
    reply.score = math.nan
    return reply.SerializeToString()


def _rehashed_slices(requests: Iterator[bytes], forward) -> bytes:
    """Every slice's hash64 recomputed over the bytes as they arrive: corruption goes unnoticed."""

    def fixed() -> Iterator[bytes]:
        for raw in requests:
            msg = inference_pb2.StageWeightsRequest.FromString(raw)
            for piece in msg.slices:
                if piece.HasField("hash64"):
                    piece.hash64 = hash64(piece.data)
            yield msg.SerializeToString()

    return forward(fixed())


def _rehashed_chunks(requests: Iterator[bytes], forward) -> bytes:
    def fixed() -> Iterator[bytes]:
        for raw in requests:
            msg = weightsync_pb2.PushShardsRequest.FromString(raw)
            for chunk in msg.shards:
                if chunk.HasField("hash64"):
                    chunk.hash64 = hash64(chunk.data)
            yield msg.SerializeToString()

    return forward(fixed())


def _ignores_min_version(request: bytes, forward) -> bytes:
    msg = inference_pb2.GenerateRequest.FromString(request)
    msg.min_weight_version = 0
    return forward(msg.SerializeToString())


def _answers_any_session(request: bytes, forward) -> bytes:
    from looprl.environment.v1 import environment_pb2

    try:
        return forward(request)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return environment_pb2.StepResponse(done=True).SerializeToString()


def _acks_twice(state: dict[str, Any]) -> Handler:
    def handle(request: bytes, forward) -> bytes:
        msg = packer_pb2.AckStepRequest.FromString(request)
        reply = forward(request)
        key = (msg.run_id, msg.step)
        first = state.setdefault(key, reply)
        return first  # a repeated acknowledgement acknowledges the step's rollouts again

    return handle


def _reports_any_run(request: bytes, forward) -> bytes:
    try:
        return forward(request)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return trainer_pb2.StatusResponse(state="idle").SerializeToString()


def mutation(contract: str) -> Mutation:
    """The one broken variant of each contract."""
    packer_state: dict[str, Any] = {}
    table = {
        "reward": Mutation("looprl.reward.v1.RewardService", "Score", "reward.score.finite", _nan_scores),
        "inference-engine": Mutation(
            "looprl.inference.v1.InferenceEngineService",
            "StageWeights",
            "inference-engine.stage.checksum_mismatch",
            _rehashed_slices,
        ),
        "weight-sync": Mutation(
            "looprl.weightsync.v1.WeightSyncService",
            "PushShards",
            "weight-sync.push.checksum_mismatch",
            _rehashed_chunks,
        ),
        "inference-router": Mutation(
            "looprl.inference.v1.InferenceRouterService",
            "Generate",
            "inference-router.generate.min_weight_version",
            _ignores_min_version,
        ),
        "environment-sandbox": Mutation(
            "looprl.environment.v1.EnvironmentSandboxService",
            "Step",
            "environment-sandbox.step.unknown_session",
            _answers_any_session,
        ),
        "rollout-packer": Mutation(
            "looprl.packer.v1.RolloutPackerService",
            "AckStep",
            "rollout-packer.ack_step.idempotent",
            _acks_twice(packer_state),
            packer_state,
        ),
        "trainer": Mutation(
            "looprl.trainer.v1.TrainerService", "Status", "trainer.status.unknown_run", _reports_any_run
        ),
    }
    return table[contract]


# ---- the proxy ----------------------------------------------------------------------------------


def _shapes(service: str) -> dict[str, tuple[bool, bool]]:
    """path -> (client streaming, server streaming) of the service, health and reflection."""
    from grpc_health.v1 import health_pb2  # noqa: F401 - registers the descriptors
    from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401

    pool = descriptor_pool.Default()
    out = {}
    for svc in (expected_service(service), pool.FindServiceByName("grpc.health.v1.Health")):
        for m in svc.methods:
            out[f"/{svc.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    reflection = pool.FindServiceByName("grpc.reflection.v1alpha.ServerReflection")
    for m in reflection.methods:
        out[f"/{reflection.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    return out


class Proxy:
    """Forwards every RPC of `mutation.service` (and health, reflection) to `backend` as the caller's
    own identity; `mutation.method` goes through `mutation.handler`. With `tls_dir` it serves with
    that directory's `server_identity` certificate and requires client certificates, like the
    backend; without, both sides are plaintext."""

    def __init__(self, backend: str, mutation: Mutation, tls_dir: Path | None, server_identity: str) -> None:
        self.backend = backend
        self.mutation = mutation
        self.tls_dir = tls_dir
        self.server_identity = server_identity
        self.shapes = _shapes(mutation.service)
        self._channels: dict[str | None, grpc.Channel] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), handlers=[_Handler(self)])
        self.address = ""

    def start(self) -> str:
        if self.tls_dir is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            creds = tls.Credentials.from_dir(self.server_identity, self.tls_dir)
            port = self.server.add_secure_port("127.0.0.1:0", creds.server_credentials())
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    def stop(self) -> None:
        self.server.stop(grace=None)
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> Proxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def channel(self, identity: str | None) -> grpc.Channel:
        if identity not in self._channels:
            options = [
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ]
            creds = (
                None
                if self.tls_dir is None or identity is None
                else tls.Credentials.from_dir(identity, self.tls_dir)
            )
            self._channels[identity] = tls.sync_channel(self.backend, options, creds=creds)
        return self._channels[identity]


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def service(self, details):  # type: ignore[override]
        shape = self.proxy.shapes.get(details.method)
        if shape is None:
            return None
        method = details.method
        client_streaming, server_streaming = shape
        mutated = method == f"/{self.proxy.mutation.service}/{self.proxy.mutation.method}"

        def forward_for(context) -> Callable[[Any], Any]:
            names = (context.auth_context() or {}).get("x509_common_name") or []
            channel = self.proxy.channel(names[0].decode() if names else None)
            timeout = context.time_remaining()
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream}
            kind.update({(True, False): channel.stream_unary, (True, True): channel.stream_stream})
            call = kind[shape](method)
            return lambda request: call(request, timeout=timeout)

        def run(request, context):
            forward = forward_for(context)
            try:
                if mutated:
                    return self.proxy.mutation.handler(request, forward)
                return forward(request)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")

        def run_stream(request, context):
            forward = forward_for(context)
            try:
                yield from (self.proxy.mutation.handler(request, forward) if mutated else forward(request))
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")

        if server_streaming:
            factory = (
                grpc.stream_stream_rpc_method_handler
                if client_streaming
                else grpc.unary_stream_rpc_method_handler
            )
            return factory(run_stream)
        factory = (
            grpc.stream_unary_rpc_method_handler if client_streaming else grpc.unary_unary_rpc_method_handler
        )
        return factory(run)
