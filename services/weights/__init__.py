"""The weight-transfer contract and its receiving side, shared by weight-sync and every replica.

Contract: parameter specs (specs.py), errors (errors.py), the Bucket protocol and slice refs
(bucket.py), the StageWeights wire format (wire.py) and slice checksums (checksum.py, with
`verify_slice`, the one check every receiver runs). Receiving side: `WeightStager` (stager.py)
stages and verifies a version beside the serving one, `WeightReceiver` (receiver.py) answers the
weight RPCs on top of it, `ShmReader` (shm.py) maps weight-sync's shared memory, probe.py answers
its shared-memory probe and device.py stages buckets that arrive as device buffers. The sending
side (transports, arenas) belongs to weight-sync: services/weight_sync/transport/.
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
from .receiver import WeightOnlyEngine, WeightReceiver, WeightServicer, add_engine_servicer, serve_engine
from .shm import ShmReader
from .specs import ParamSpec, as_param_specs, itemsize, proto_dtype
from .stager import StageProgress, WeightStager

__all__ = [
    "Bucket",
    "BytesBucket",
    "ChecksumMismatch",
    "DeliveryError",
    "IncompleteVersion",
    "InvalidWeights",
    "ParamSpec",
    "ShmReader",
    "SliceRef",
    "StageProgress",
    "StaleVersion",
    "WeightOnlyEngine",
    "WeightReceiver",
    "WeightServicer",
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
    "tensors_bucket",
]
