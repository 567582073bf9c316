"""What a deployment's `weight_transport` means: the one place a transport kind becomes a Transport.

A recipe names, per deployment, how weight-sync reaches its replicas (services/kit/config/recipe.py
DeploymentSpec.weight_transport, sent in RegisterTargetRequest.weight_transport):

- auto: shared memory to the ranks placement.py proved co-located, gRPC to the others.
- grpc: gRPC streams to every rank, co-located or not.
- shm: shared memory (as weight-sync's shared-copy settings say); every rank must be co-located.
- shared_copy: one shared copy of the layout that every co-located rank serves from, even alone.
- cuda_ipc: a device buffer per bucket, handed over by CUDA IPC; co-located ranks, CUDA required.
- nccl: a broadcast from weight-sync (rank 0 of a NCCL group) to the ranks; CUDA and a group required.

`check_kind` refuses a kind this host cannot run, naming the field it came from, so a GPU transport
picked on a CPU-only host fails where it is chosen instead of quietly becoming another one.
`Transports` holds one Transport per kind in use (created on first use) and resolves each rank's
kind: the weight-sync deliverer (deliver.py) asks it for every rank of every delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.kit.rpc.errors import InvalidArgument
from services.weights.errors import DeliveryError

from .base import Transport
from .grpc_stream import GrpcTransport
from .shm import ShmTransport

KINDS = ("auto", "grpc", "shm", "shared_copy", "cuda_ipc", "nccl")
GPU_KINDS = frozenset({"cuda_ipc", "nccl"})
CO_LOCATED_KINDS = frozenset({"shm", "shared_copy", "cuda_ipc"})  # ranks must share weight-sync's host


class TransportUnavailable(InvalidArgument):
    """A transport kind that is unknown or cannot run on this host; the message names the field."""


@dataclass(frozen=True)
class TransportSettings:
    """How weight-sync builds its transports (services/weight_sync/config.py)."""

    bucket_bytes: int = 32 << 20
    shm_segments: int = 3
    shared_copy_min_receivers: int = 2
    shared_copies: int = 3
    prefetch: int = 2
    device: str = "cuda"
    nccl_group: Any = None  # torch.distributed group with the receivers; None: nccl unavailable


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_kind(
    kind: str,
    *,
    where: str = "weight_transport",
    settings: TransportSettings | None = None,
    has_cuda: Callable[[], bool] = cuda_available,
) -> str:
    """The kind ("" means auto) if this host can run it; TransportUnavailable naming `where` if not."""
    kind = kind or "auto"
    if kind not in KINDS:
        raise TransportUnavailable(f"{where}: unknown transport {kind!r} ({', '.join(KINDS)})")
    if kind in GPU_KINDS and not has_cuda():
        raise TransportUnavailable(
            f"{where}: {kind} needs a CUDA device on weight-sync's host and it has none; choose auto, "
            "grpc, shm or shared_copy"
        )
    if kind == "nccl" and (settings is None or settings.nccl_group is None):
        raise TransportUnavailable(
            f"{where}: nccl needs a NCCL process group between weight-sync and the replicas, and "
            "weight-sync has none; choose cuda_ipc for co-located GPU replicas"
        )
    return kind


def make_transport(
    kind: str,
    settings: TransportSettings = TransportSettings(),
    *,
    where: str = "weight_transport",
    has_cuda: Callable[[], bool] = cuda_available,
) -> Transport:
    """A new Transport of a concrete kind (auto is resolved per rank by `Transports.route`)."""
    kind = check_kind(kind, where=where, settings=settings, has_cuda=has_cuda)
    if kind == "grpc":
        return GrpcTransport(prefetch=settings.prefetch)
    if kind in ("shm", "shared_copy"):
        return ShmTransport(
            segment_bytes=settings.bucket_bytes,
            segments=settings.shm_segments,
            shared_copies=settings.shared_copies,
            share_min_receivers=1 if kind == "shared_copy" else settings.shared_copy_min_receivers,
        )
    from .gpu import CudaIpcTransport, NcclBroadcastTransport  # torch.cuda only where asked for

    if kind == "cuda_ipc":
        return CudaIpcTransport(device=settings.device)
    if kind == "nccl":
        return NcclBroadcastTransport(settings.nccl_group, device=settings.device)
    raise ValueError("auto names no single transport: Transports.resolve picks one per rank")


class Transports:
    """One Transport per kind in use, and which of them reaches a given rank."""

    def __init__(
        self,
        settings: TransportSettings = TransportSettings(),
        *,
        has_cuda: Callable[[], bool] = cuda_available,
    ) -> None:
        self.settings = settings
        self.has_cuda = has_cuda
        self._made: dict[str, Transport] = {}

    @property
    def control(self) -> GrpcTransport:
        """The gRPC transport: commit, abort, status and probes go through it for every kind."""
        transport = self.get("grpc")
        assert isinstance(transport, GrpcTransport)
        return transport

    def get(self, kind: str) -> Transport:
        transport = self._made.get(kind)
        if transport is None:
            transport = self._made[kind] = make_transport(kind, self.settings, has_cuda=self.has_cuda)
        return transport

    def check(self, kind: str, where: str = "weight_transport") -> str:
        """`kind` if this host can run it (see `check_kind`)."""
        return check_kind(kind, where=where, settings=self.settings, has_cuda=self.has_cuda)

    def resolve(self, kind: str, *, co_located: bool, why: str = "") -> str:
        """The concrete kind that delivers to one rank of a deployment whose weight_transport is
        `kind`; `co_located` is placement's verdict for that rank and `why` its reason. A kind that
        needs the rank on this host and cannot have it, or that this host cannot run (a registration
        restored after weight-sync moved), fails the delivery (DeliveryError) rather than sending
        the bytes another way."""
        try:
            kind = self.check(kind)
        except TransportUnavailable as exc:
            raise DeliveryError(str(exc)) from None
        if kind == "auto":
            return "shm" if co_located else "grpc"
        if kind in CO_LOCATED_KINDS and not co_located:
            raise DeliveryError(f"weight_transport {kind} needs the replica on weight-sync's host: {why}")
        return kind

    async def close(self) -> None:
        for transport in self._made.values():
            await transport.close()
        self._made.clear()
