"""The receiving side of the shared-memory probe: proof, not assumption, that a receiver sees
weight-sync's /dev/shm.

Weight-sync writes a fresh random nonce into a small segment of its own (ProbeSegment,
services/weight_sync/transport/arena.py) and asks the receiver
(InferenceEngineService.ProbeSharedMemory) to read it back; the receiver answers with `read_probe`. Only when the bytes come back equal does weight-sync send that receiver shared-memory
buckets. A receiver in another mount namespace, container or machine finds no such segment, or
another one of the same name, and gets gRPC.
"""

from __future__ import annotations

from looprl.inference.v1 import inference_pb2
from services.kit.process.hosts import host_identity, shm_dir
from services.kit.rpc.errors import InvalidArgument, NotFound

from .shm import validate_segment_name

NONCE_BYTES = 32
MAX_PROBE_BYTES = 4096


def read_probe(request: inference_pb2.ProbeSharedMemoryRequest) -> inference_pb2.ProbeSharedMemoryResponse:
    """The receiver's side: read the first bytes of a weight-sync segment in this host's shm dir."""
    try:
        validate_segment_name(request.segment)
    except ValueError:
        raise InvalidArgument(f"segment: {request.segment!r} is not a weight-sync segment name") from None
    if not 0 < request.nbytes <= MAX_PROBE_BYTES:
        raise InvalidArgument(f"nbytes: must be in 1..{MAX_PROBE_BYTES}, got {request.nbytes}")
    try:
        with open(shm_dir() / request.segment, "rb") as f:
            data = f.read(request.nbytes)
    except FileNotFoundError:
        raise NotFound(f"segment: {request.segment!r} does not exist in {shm_dir()} on this host") from None
    return inference_pb2.ProbeSharedMemoryResponse(data=data, host_id=host_identity())
