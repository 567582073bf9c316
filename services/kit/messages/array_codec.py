"""numpy arrays to looprl.common.v1.Tensor without torch, for services that never touch torch
(the rollout-packer: importing torch costs it ~1.4 s of CPU at start and ~300 MB).
services/kit/messages/codec.py decodes the same messages into torch tensors."""

from __future__ import annotations

import numpy as np

from looprl.common.v1 import common_pb2

DType = common_pb2.DType

NUMPY_TO_PROTO: dict[np.dtype, common_pb2.DType] = {
    np.dtype(np.float32): DType.D_TYPE_FLOAT32,
    np.dtype(np.float16): DType.D_TYPE_FLOAT16,
    np.dtype(np.int32): DType.D_TYPE_INT32,
    np.dtype(np.int64): DType.D_TYPE_INT64,
    np.dtype(np.bool_): DType.D_TYPE_BOOL,
    np.dtype(np.uint8): DType.D_TYPE_UINT8,
}


class CodecError(ValueError):
    """A tensor message does not describe a valid tensor."""


def array_to_proto(array: np.ndarray) -> common_pb2.Tensor:
    """The array's elements as C-order bytes in the host's (little-endian) order, one copy."""
    array = np.ascontiguousarray(array)
    if array.dtype not in NUMPY_TO_PROTO:
        raise CodecError(f"unsupported dtype {array.dtype}")
    return common_pb2.Tensor(dtype=NUMPY_TO_PROTO[array.dtype], shape=list(array.shape), data=array.tobytes())
