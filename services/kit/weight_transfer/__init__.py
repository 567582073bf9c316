"""Weight transfer: what weight-sync and every inference replica must agree on.

Receiver side (inside a replica): `WeightStager` (+ `WeightReceiver` for the gRPC methods).
Sender side (weight-sync): `Bucket`/`SliceRef`, `Transport` with `GrpcTransport`,
`ShmTransport`, and the device transports in `gpu`.
"""

from .bucket import Bucket, BytesBucket, SliceRef, set_checksums, tensors_bucket
from .checksum import copy_and_hash64, hash64
from .errors import (
    ChecksumMismatch,
    DeliveryError,
    IncompleteVersion,
    InvalidWeights,
    StaleVersion,
    WeightTransferError,
)
from .receiver import WeightOnlyEngine, WeightReceiver, add_engine_servicer, serve_engine
from .shm import ShmPool, ShmReader, sweep_stale_segments
from .specs import ParamSpec, as_param_specs, itemsize, proto_dtype
from .stager import StageProgress, WeightStager
from .transport import Endpoint, GrpcTransport, ShmTransport, StageResult, Transport

__all__ = [
    "Bucket",
    "BytesBucket",
    "ChecksumMismatch",
    "DeliveryError",
    "Endpoint",
    "GrpcTransport",
    "IncompleteVersion",
    "InvalidWeights",
    "ParamSpec",
    "ShmPool",
    "ShmReader",
    "ShmTransport",
    "SliceRef",
    "StageProgress",
    "StageResult",
    "StaleVersion",
    "Transport",
    "WeightOnlyEngine",
    "WeightReceiver",
    "WeightStager",
    "WeightTransferError",
    "add_engine_servicer",
    "as_param_specs",
    "copy_and_hash64",
    "hash64",
    "itemsize",
    "proto_dtype",
    "serve_engine",
    "set_checksums",
    "sweep_stale_segments",
    "tensors_bucket",
]
