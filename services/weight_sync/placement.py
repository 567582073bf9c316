"""Where each receiver rank is, and so which transport reaches it: shared memory or gRPC.

A rank gets shared memory only when both hold: the host identity it registered equals weight-sync's
own (services/kit/process/hosts.py), and it reads back a nonce weight-sync has just written into a probe
segment (services/weight_sync/transport/arena.py ProbeSegment). Anything else (another host, no identity, a probe
that fails, times out or reads other bytes, an engine without the probe RPC) is gRPC, with the reason
kept beside the route. A route is decided once per endpoint (address, rank, host identity): a
replica that restarts registers a new address and is probed again.

Bytes delivered are counted per route and in the Prometheus counter
`looprl_weight_sync_delivered_bytes_total{transport, host}`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from looprl.inference.v1 import inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.process.hosts import host_identity
from services.kit.telemetry.metrics import counter
from services.weight_sync.transport import Endpoint
from services.weight_sync.transport.arena import ProbeSegment

log = logging.getLogger("looprl.weight_sync.placement")

SHM = "shm"
GRPC = "grpc"

DELIVERED_BYTES = counter("looprl_weight_sync_delivered_bytes_total")

StubFor = Callable[[str], inference_pb2_grpc.InferenceEngineServiceStub]


@dataclass
class Route:
    transport: str  # SHM | GRPC
    reason: str
    bytes_delivered: int = 0
    settled: bool = True  # False: the probe could not reach the rank; probed again next delivery


class Placement:
    """Routes of every endpoint weight-sync delivers to."""

    def __init__(self, stub_for: StubFor, *, host_id: str = "", probe_timeout_s: float = 5.0) -> None:
        self.stub_for = stub_for
        self.host_id = host_id or host_identity()
        self.probe_timeout_s = probe_timeout_s
        self.routes: dict[Endpoint, Route] = {}

    async def place(self, endpoints: Iterable[Endpoint]) -> None:
        """Decide the route of every endpoint that has none yet (probing those on this host)."""
        todo = [e for e in dict.fromkeys(endpoints) if e not in self.routes or not self.routes[e].settled]
        for ep, route in zip(todo, await asyncio.gather(*(self._decide(e) for e in todo)), strict=True):
            old = self.routes.get(ep)
            route.bytes_delivered = old.bytes_delivered if old is not None else 0
            self.routes[ep] = route
            log.info(
                "%s (host %s) receives weights over %s: %s",
                ep,
                ep.host_id or "?",
                route.transport,
                route.reason,
            )

    def uses_shm(self, ep: Endpoint) -> bool:
        route = self.routes.get(ep)
        return route is not None and route.transport == SHM

    def reason(self, ep: Endpoint) -> str:
        route = self.routes.get(ep)
        return route.reason if route is not None else "not placed yet"

    def delivered(self, ep: Endpoint, nbytes: int, transport: str) -> None:
        """Count bytes sent to `ep` over `transport` (the kind that reached it)."""
        route = self.routes.get(ep)
        if route is not None:
            route.bytes_delivered += nbytes
        DELIVERED_BYTES.labels(transport, ep.host_id or "unknown").inc(nbytes)

    def forget_except(self, keep: Iterable[Endpoint]) -> None:
        """Drop the routes of endpoints no target lists any more (replicas gone or moved)."""
        kept = set(keep)
        for ep in [e for e in self.routes if e not in kept]:
            del self.routes[ep]

    def to_proto(self, ep: Endpoint, transport: str = "") -> weightsync_pb2.DeliveryRoute:
        """The rank's route; `transport` is the kind that reaches it when the target names one."""
        route = self.routes.get(ep) or Route(GRPC, "not placed yet")
        return weightsync_pb2.DeliveryRoute(
            replica=ep.replica,
            rank=ep.rank,
            address=ep.address,
            host_id=ep.host_id,
            transport=transport or route.transport,
            reason=route.reason,
            bytes_delivered=route.bytes_delivered,
        )

    async def _decide(self, ep: Endpoint) -> Route:
        if not ep.host_id:
            return Route(GRPC, "no host identity registered")
        if ep.host_id != self.host_id:
            return Route(GRPC, f"other host ({ep.host_id}, weight-sync is on {self.host_id})")
        try:
            probe = ProbeSegment()
        except OSError as exc:  # no writable shared-memory directory here: nobody can share it
            return Route(GRPC, f"no probe segment: {exc}")
        with probe:
            try:
                reply = await self.stub_for(ep.address).ProbeSharedMemory(
                    probe.request(), timeout=self.probe_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                unreachable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                return Route(
                    GRPC, f"probe failed: {exc.code().name}: {exc.details()}", settled=not unreachable
                )
        if reply.data != probe.nonce:
            return Route(GRPC, "probe failed: the segment it read holds other bytes")
        if reply.host_id and reply.host_id != self.host_id:
            return Route(GRPC, f"probe failed: the replica answered from host {reply.host_id}")
        return Route(SHM, "same host, probe read back")
