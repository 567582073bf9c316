"""Tensor codec between torch/numpy and looprl.common.v1.Tensor (raw little-endian bytes).

Decoding wraps the message's bytes without copying (the result is read-only memory shared with
the message; call .clone() before writing into it). Encoding copies once, from the tensor's
memory into the protobuf bytes field, which protobuf requires.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from looprl.common.v1 import common_pb2
from services.kit.messages.array_codec import CodecError, array_to_proto

DType = common_pb2.DType

TORCH_TO_PROTO: dict[torch.dtype, common_pb2.DType] = {
    torch.float32: DType.D_TYPE_FLOAT32,
    torch.float16: DType.D_TYPE_FLOAT16,
    torch.bfloat16: DType.D_TYPE_BFLOAT16,
    torch.int32: DType.D_TYPE_INT32,
    torch.int64: DType.D_TYPE_INT64,
    torch.bool: DType.D_TYPE_BOOL,
    torch.uint8: DType.D_TYPE_UINT8,
}
PROTO_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_PROTO.items()}
NAME_TO_TORCH: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "uint8": torch.uint8,
}


def torch_dtype(name_or_proto: str | int) -> torch.dtype:
    """torch dtype from a name ("float32") or a DType enum value."""
    table = NAME_TO_TORCH if isinstance(name_or_proto, str) else PROTO_TO_TORCH
    try:
        return table[name_or_proto]  # type: ignore[index]
    except KeyError:
        raise CodecError(f"unsupported dtype {name_or_proto!r}") from None


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as C-order bytes (one copy)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        # numpy has no bfloat16: reinterpret the same 2-byte words.
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def tensor_to_proto(value: torch.Tensor | np.ndarray) -> common_pb2.Tensor:
    if isinstance(value, np.ndarray):
        return array_to_proto(value)
    if value.dtype not in TORCH_TO_PROTO:
        raise CodecError(f"unsupported dtype {value.dtype}")
    return common_pb2.Tensor(
        dtype=TORCH_TO_PROTO[value.dtype], shape=list(value.shape), data=tensor_to_bytes(value)
    )


def tensor_from_bytes(
    data: bytes | memoryview, dtype: torch.dtype, shape: list[int] | tuple[int, ...]
) -> torch.Tensor:
    """A tensor viewing `data` (no copy). Raises CodecError when sizes disagree."""
    itemsize = dtype.itemsize
    count = 1
    for dim in shape:
        if dim < 0:
            raise CodecError(f"negative dimension in shape {list(shape)}")
        count *= dim
    if len(data) != count * itemsize:
        raise CodecError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {count * itemsize} bytes, got {len(data)}"
        )
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        # The view is read-only by contract (see module docstring); torch warns regardless.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=dtype)
    return flat.view(tuple(shape))


def tensor_from_proto(message: common_pb2.Tensor) -> torch.Tensor:
    if message.dtype not in PROTO_TO_TORCH:
        raise CodecError(f"unsupported or unset dtype {message.dtype}")
    return tensor_from_bytes(message.data, PROTO_TO_TORCH[message.dtype], list(message.shape))
