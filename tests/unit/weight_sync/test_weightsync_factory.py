"""The transport factory: each weight_transport kind resolves to its transport, per rank for auto,
and a kind this host cannot run fails naming the field it came from (no quiet fallback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from looprl.weightsync.v1 import weightsync_pb2 as ws
from services.kit.config.recipe import WEIGHT_TRANSPORTS
from services.kit.rpc.errors import InvalidArgument
from services.weight_sync.targets import target_from_request
from services.weight_sync.transport import GrpcTransport, ShmTransport
from services.weight_sync.transport.factory import (
    KINDS,
    Transports,
    TransportSettings,
    TransportUnavailable,
    check_kind,
    make_transport,
)
from services.weight_sync.transport.gpu import CudaIpcTransport, NcclBroadcastTransport
from services.weights.errors import DeliveryError

GROUP = object()  # stands in for a torch.distributed group: only its presence matters here
SETTINGS = TransportSettings(shared_copy_min_receivers=2, nccl_group=GROUP)


def cuda() -> bool:
    return True


def no_cuda() -> bool:
    return False


def test_the_recipe_and_the_factory_name_the_same_kinds():
    assert tuple(KINDS) == tuple(WEIGHT_TRANSPORTS)


@pytest.mark.parametrize(
    "kind,cls,share",
    [
        ("grpc", GrpcTransport, None),
        ("shm", ShmTransport, 2),  # weight-sync's own shared-copy threshold
        ("shared_copy", ShmTransport, 1),  # one shared copy even for a single receiver
        ("cuda_ipc", CudaIpcTransport, None),
        ("nccl", NcclBroadcastTransport, None),
    ],
)
def test_each_kind_makes_its_transport(kind, cls, share):
    transport = make_transport(kind, SETTINGS, has_cuda=cuda)
    try:
        assert type(transport) is cls and transport.name == ("shm" if cls is ShmTransport else kind)
        if share is not None:
            assert transport.share_min_receivers == share
        if cls is NcclBroadcastTransport:
            assert transport.group is GROUP
    finally:
        asyncio.run(transport.close())


def test_auto_is_shared_memory_for_co_located_ranks_and_grpc_for_the_others():
    transports = Transports(SETTINGS, has_cuda=no_cuda)
    try:
        assert transports.resolve("auto", co_located=True) == "shm"
        assert transports.resolve("", co_located=True) == "shm"  # unset in the registration: auto
        assert transports.resolve("auto", co_located=False) == "grpc"
        assert transports.resolve("grpc", co_located=True) == "grpc"
        assert isinstance(transports.get("shm"), ShmTransport) and transports.get("shm") is transports.get(
            "shm"
        )
        assert transports.control is transports.get("grpc")
    finally:
        asyncio.run(transports.close())


@pytest.mark.parametrize("kind", ["shm", "shared_copy", "cuda_ipc"])
def test_a_co_located_kind_fails_for_a_rank_on_another_host_instead_of_using_grpc(kind):
    transports = Transports(SETTINGS, has_cuda=cuda)
    with pytest.raises(
        DeliveryError, match=f"weight_transport {kind} needs the replica on weight-sync's host: other"
    ):
        transports.resolve(kind, co_located=False, why="other host (b, weight-sync is on a)")
    assert transports.resolve(kind, co_located=True) == kind
    assert transports.resolve("nccl", co_located=False) == "nccl"  # a broadcast crosses hosts


@pytest.mark.parametrize("kind", ["cuda_ipc", "nccl"])
def test_gpu_kinds_on_a_host_without_cuda_fail_naming_the_recipe_field(kind):
    with pytest.raises(TransportUnavailable) as info:
        make_transport(kind, SETTINGS, where="deployments[1].weight_transport", has_cuda=no_cuda)
    assert str(info.value).startswith(f"deployments[1].weight_transport: {kind} needs a CUDA device")
    assert isinstance(info.value, InvalidArgument) and info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(DeliveryError, match=rf"^weight_transport: {kind} needs a CUDA device"):
        Transports(SETTINGS, has_cuda=no_cuda).resolve(kind, co_located=True)  # a restored registration


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this host's own answer: it has no CUDA")
def test_this_cpu_only_host_refuses_the_gpu_kinds_by_default():
    for kind in ("cuda_ipc", "nccl"):
        with pytest.raises(TransportUnavailable, match="needs a CUDA device"):
            check_kind(kind, where="deployments[0].weight_transport", settings=SETTINGS)


def test_nccl_without_a_group_and_unknown_kinds_are_refused():
    with pytest.raises(TransportUnavailable, match="nccl needs a NCCL process group"):
        check_kind("nccl", settings=TransportSettings(), has_cuda=cuda)
    with pytest.raises(TransportUnavailable, match=r"^weight_transport: unknown transport 'pigeon'"):
        check_kind("pigeon", has_cuda=cuda)
    with pytest.raises(ValueError, match="auto names no single transport"):
        make_transport("auto", SETTINGS)


def test_a_registration_carries_its_transport_and_an_unknown_one_names_the_field():
    ranks = [ws.TargetRank(rank=0, address="h:1")]
    layout = ws.TargetLayout(tensor_parallel=1, naming="hf")
    assert (
        target_from_request(ws.RegisterTargetRequest(deployment="d", layout=layout, ranks=ranks)).transport
        == "auto"
    )
    t = target_from_request(
        ws.RegisterTargetRequest(deployment="d", layout=layout, ranks=ranks, weight_transport="shared_copy")
    )
    assert t.transport == "shared_copy"
    with pytest.raises(InvalidArgument, match=r"^weight_transport: unknown transport 'x'"):
        target_from_request(
            ws.RegisterTargetRequest(deployment="d", layout=layout, ranks=ranks, weight_transport="x")
        )
