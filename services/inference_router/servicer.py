"""The InferenceRouterService gRPC servicer: validates requests, hands them to the Router, and
exposes deployments.

Validation happens here, before any routing, so bad input is INVALID_ARGUMENT naming the field and
never costs a replica a slot. Checks that depend on a deployment (vocabulary, model length, unknown
name) use what the deployments reported about themselves.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import grpc

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.deployments import DeploymentManager
from services.inference_router.router import Router
from services.kit.rpc.errors import InvalidArgument, Unavailable

# Group sampling beyond this is almost certainly a mistake and would pin a replica for long.
MAX_N = 256


class InferenceRouterServicer(inference_pb2_grpc.InferenceRouterServiceServicer):
    def __init__(self, router: Router, deployments: DeploymentManager) -> None:
        self.router = router
        self.deployments = deployments

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        self.validate(request)
        return await self.router.generate(request, _remaining(context))

    async def GenerateStream(
        self, request: inference_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        self.validate(request.request, prefix="request.")
        async for chunk in self.router.generate_stream(request.request, _remaining(context)):
            yield chunk

    async def ListDeployments(
        self, request: inference_pb2.ListDeploymentsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListDeploymentsResponse:
        return inference_pb2.ListDeploymentsResponse(
            deployments=describe(self.router),
            starts_run_deployments=self.router.config.starts_run_deployments,
        )

    async def RegisterDeployment(
        self, request: inference_pb2.RegisterDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.RegisterDeploymentResponse:
        await self.deployments.register_external(request.deployment)
        return inference_pb2.RegisterDeploymentResponse()

    async def GetClusterResources(
        self, request: inference_pb2.GetClusterResourcesRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetClusterResourcesResponse:
        from services.kit.ray.cluster import cluster_resources, connect_ray

        cfg = self.router.config

        def read() -> tuple[dict[str, float], dict[str, float]]:
            connect_ray(cfg.ray_address, cfg.namespace)  # once per process: a no-op when joined
            return cluster_resources()

        try:
            total, in_use = await asyncio.to_thread(read)
        except Exception as exc:  # the head down or restarting, no node registered yet
            raise Unavailable(f"the Ray cluster did not say its resources: {exc}") from exc
        return inference_pb2.GetClusterResourcesResponse(total=total, in_use=in_use)

    def validate(self, request: inference_pb2.GenerateRequest, prefix: str = "") -> None:
        validate_request(request, self.router, prefix)


def validate_request(request: inference_pb2.GenerateRequest, router: Router, prefix: str = "") -> None:
    """Raise InvalidArgument naming the first bad field (paths relative to `prefix`)."""

    def bad(field: str, what: str) -> InvalidArgument:
        return InvalidArgument(f"{prefix}{field}: {what}")

    s = request.sampling
    if not request.prompt_token_ids:
        raise bad("prompt_token_ids", "must not be empty")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise bad("sampling.temperature", f"must be >= 0 (0 is greedy), got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
        raise bad("sampling.top_p", f"must be in (0, 1] (0 reads as 1), got {s.top_p}")
    if s.top_k < 0:
        raise bad("sampling.top_k", f"must be >= 0 (0 disables), got {s.top_k}")
    if s.max_tokens <= 0:
        raise bad("sampling.max_tokens", f"must be > 0, got {s.max_tokens}")
    if s.n < 0 or s.n > MAX_N:
        raise bad("sampling.n", f"must be in [0, {MAX_N}] (0 reads as 1), got {s.n}")
    if request.min_weight_version < 0:
        raise bad("min_weight_version", f"must be >= 0, got {request.min_weight_version}")
    if request.expected_output_tokens < 0:
        raise bad("expected_output_tokens", f"must be >= 0, got {request.expected_output_tokens}")
    pinned = ""
    if request.deployment:
        try:
            pinned = router.runs.resolve(router.deployments, request.run_id, request.deployment)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{prefix}{exc.message}") from None
    vocab = _vocab_size(router, pinned, request.run_id)
    for field, ids in (
        ("prompt_token_ids", request.prompt_token_ids),
        ("sampling.stop_token_ids", s.stop_token_ids),
    ):
        for i, token in enumerate(ids):
            if token < 0 or (vocab and token >= vocab):
                limit = f"[0, {vocab})" if vocab else "non-negative ids"
                raise bad(f"{field}[{i}]", f"token id {token} is outside the vocabulary {limit}")
    # prompt + max_tokens against the model length is checked by routing (it knows which deployments
    # could hold the request) and reported as sampling.max_tokens.


def _vocab_size(router: Router, deployment: str, run_id: str) -> int:
    """The vocabulary every candidate deployment accepts (0 when none reported one)."""
    if deployment:
        deps = [router.deployments[deployment]] if deployment in router.deployments else []
    else:
        deps = router.runs.candidates(router.deployments, run_id)
    sizes = [d.vocab_size for d in deps if d.vocab_size > 0]
    return min(sizes) if sizes else 0


def _remaining(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e6 else None


def describe(router: Router) -> list[inference_pb2.DeploymentInfo]:
    """Every deployment as ListDeployments shows it."""
    out = []
    for dep in router.deployment_list():
        p = dep.profile
        out.append(
            inference_pb2.DeploymentInfo(
                name=dep.name,
                backend=dep.backend,
                tensor_parallel=dep.tensor_parallel,
                profile=inference_pb2.LengthProfile(
                    min_prompt_tokens=p.min_prompt_tokens,
                    max_prompt_tokens=p.max_prompt_tokens,
                    min_output_tokens=p.min_output_tokens,
                    max_output_tokens=p.max_output_tokens,
                ),
                max_model_len=dep.max_model_len,
                layout=dep.layout,
                dtype=dep.dtype,
                run_id=dep.run_id,
                replicas=[
                    inference_pb2.ReplicaInfo(
                        name=r.name,
                        healthy=r.routable,
                        weight_version=r.weight_version,
                        outstanding_tokens=r.outstanding_tokens,
                        outstanding_requests=r.outstanding_requests,
                        address=r.address,
                        metrics_address=r.metrics_address,
                        role=r.role,
                    )
                    for r in dep.replicas
                ],
                split_decision=dep.split_decision,
            )
        )
    return out
