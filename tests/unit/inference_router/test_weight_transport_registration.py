"""A deployment's recipe `weight_transport` reaches weight-sync in its registration, and a kind
weight-sync refuses (a GPU transport on a host without CUDA) fails the deployment's start naming
`deployments[i].weight_transport` instead of leaving it to run without weights."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.inference_router.config import RouterConfig
from services.inference_router.deployments import DeploymentManager
from services.inference_router.policies import DeploymentState, ReplicaState
from services.inference_router.router import Router
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.errors import InvalidArgument
from services.weight_sync.transport.factory import TransportSettings, TransportUnavailable, check_kind


class _CpuOnlyWeightSync:
    """Answers RegisterTarget as weight-sync on a host without CUDA does (the factory's own check)."""

    def __init__(self) -> None:
        self.requests = []

    async def RegisterTarget(self, request, timeout=None):
        self.requests.append(request)
        try:
            check_kind(request.weight_transport, settings=TransportSettings(), has_cuda=lambda: False)
        except TransportUnavailable as exc:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), str(exc)
            ) from None

        class Reply:
            current_version = -1

        return Reply()


def _manager(transport: str) -> tuple[DeploymentManager, DeploymentState]:
    dep = DeploymentState(name="d", tensor_parallel=1)
    dep.replicas.append(ReplicaState(name="d-r0", deployment="d", max_outstanding_requests=8))
    manager = DeploymentManager(Router(), RouterConfig(weight_sync_address="recorded"))
    manager.specs["d"] = DeploymentSpec(name="d", weight_transport=transport)
    manager._where["d"] = "deployments[1]"  # what start(spec, where=...) records from the recipe

    async def addresses(replica: ReplicaState) -> tuple[list[str], str]:
        return ["127.0.0.1:1"], "host-a"

    manager._rank_addresses = addresses  # type: ignore[method-assign]
    manager._weight_sync = _CpuOnlyWeightSync()
    return manager, dep


@pytest.mark.parametrize("kind", ["cuda_ipc", "nccl"])
def test_a_gpu_transport_refused_by_weight_sync_fails_the_start_naming_the_recipe_field(kind):
    async def run() -> None:
        manager, dep = _manager(kind)
        with pytest.raises(
            InvalidArgument, match=rf"^deployments\[1\]\.weight_transport: {kind} needs a CUDA"
        ):
            await manager.register_with_weight_sync(dep, 1, strict=True)
        [request] = manager._weight_sync.requests
        assert request.weight_transport == kind
        await manager.register_with_weight_sync(dep, 1)  # a later re-registration only logs it

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["auto", "grpc", "shm", "shared_copy"])
def test_a_host_transport_is_sent_and_accepted(kind):
    async def run() -> None:
        manager, dep = _manager(kind)
        await manager.register_with_weight_sync(dep, 1, strict=True)
        [request] = manager._weight_sync.requests
        assert request.weight_transport == kind and request.deployment == "d-r0"

    asyncio.run(run())
