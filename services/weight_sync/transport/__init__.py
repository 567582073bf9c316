"""How weight-sync sends a version's buckets to the receivers of one delivery group.

base.py is the interface (`Transport.stage/commit/abort`, what a delivery carries, endpoints, results); grpc_stream.py,
shm.py (with shared_copy.py) and gpu.py implement it; arena.py holds the shared-memory segments
weight-sync writes. factory.py resolves a recipe's `weight_transport` to one of them.
"""

from .arena import ArenaPool, ChunkArena, ProbeSegment, ShmPool, sweep_stale_segments
from .base import Delivery, Endpoint, StageResult, Transport
from .grpc_stream import GrpcTransport
from .shm import ShmTransport

__all__ = [
    "ArenaPool",
    "ChunkArena",
    "Delivery",
    "Endpoint",
    "GrpcTransport",
    "ProbeSegment",
    "ShmPool",
    "ShmTransport",
    "StageResult",
    "Transport",
    "sweep_stale_segments",
]
