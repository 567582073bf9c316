"""What a receiver holds: parameter specs and dtype helpers shared by stager, plans and transports."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from looprl.common.v1 import common_pb2
from services.kit.messages.codec import PROTO_TO_TORCH, TORCH_TO_PROTO


@dataclass(frozen=True)
class ParamSpec:
    """One tensor a receiver holds, in its own naming and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def itemsize(dtype: torch.dtype) -> int:
    # The dtype's own attribute: allocating a tensor to ask costs ~5 us, on every slice of every push.
    return dtype.itemsize


def proto_dtype(dtype: torch.dtype) -> common_pb2.DType:
    return TORCH_TO_PROTO[dtype]


def torch_dtype_of(proto: int) -> torch.dtype | None:
    return PROTO_TO_TORCH.get(proto)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ParamLike(Protocol):
    """Anything that names a parameter, its shape and dtype (a torch dtype or its name), such as
    services.modeling.layouts TargetParam."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> torch.dtype | str: ...


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...)."""
    dtype = _DTYPES_BY_NAME.get(name)
    if dtype is None:
        raise ValueError(f"dtype: unknown dtype {name!r} ({', '.join(sorted(_DTYPES_BY_NAME))})")
    return dtype


_DTYPES_BY_NAME = {dtype_name(d): d for d in TORCH_TO_PROTO}


def as_param_specs(params: Iterable[ParamLike] | Mapping[str, torch.Tensor]) -> list[ParamSpec]:
    """ParamSpecs from a state dict, from ParamSpecs, or from any ParamLike."""
    if isinstance(params, Mapping):
        return [ParamSpec(name, tuple(t.shape), t.dtype) for name, t in params.items()]
    specs = []
    for p in params:
        if isinstance(p, ParamSpec):
            specs.append(p)
            continue
        dtype = dtype_named(p.dtype) if isinstance(p.dtype, str) else p.dtype
        specs.append(ParamSpec(str(p.name), tuple(int(d) for d in p.shape), dtype))
    return specs
