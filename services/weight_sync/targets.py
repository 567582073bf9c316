"""Registered targets (inference deployments): layout, rank endpoints, policy and sync state."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from looprl.common.v1 import common_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.errors import InvalidArgument
from services.kit.weight_transfer import Endpoint
from services.modeling.layouts import Layout

_DTYPES = {
    common_pb2.DType.D_TYPE_FLOAT32: "float32",
    common_pb2.DType.D_TYPE_BFLOAT16: "bfloat16",
    common_pb2.DType.D_TYPE_FLOAT16: "float16",
    common_pb2.DType.D_TYPE_UNSPECIFIED: "float32",
}


@dataclass
class Target:
    deployment: str
    layout: Layout
    endpoints: list[Endpoint]
    every_k: int = 1
    canary: bool = False
    run_id: str = ""
    registration: weightsync_pb2.RegisterTargetRequest | None = None
    version: int = -1
    state: str = "registered"  # registered | syncing | ready | failed
    last_error: str = ""
    last_bytes: int = 0
    last_sync_seconds: float = 0.0
    attempts: dict[int, int] = field(default_factory=dict)

    def due(self, version: int) -> bool:
        """Policy: every k-th version (version 0, the initial weights, always; and never backwards)."""
        if version <= self.version:
            return False
        return self.version < 0 or version - self.version >= self.every_k or version % self.every_k == 0

    def to_proto(self) -> weightsync_pb2.TargetVersion:
        return weightsync_pb2.TargetVersion(
            deployment=self.deployment, version=self.version, state=self.state, last_error=self.last_error,
            last_bytes=self.last_bytes, last_sync_seconds=self.last_sync_seconds,
        )  # fmt: skip


def target_from_request(req: weightsync_pb2.RegisterTargetRequest) -> Target:
    """Validate a registration; errors name the field."""
    if not req.deployment:
        raise InvalidArgument("deployment: must not be empty")
    lay = req.layout
    tp = lay.tensor_parallel or 1
    if tp < 1:
        raise InvalidArgument(f"layout.tensor_parallel: must be >= 1, got {lay.tensor_parallel}")
    naming = lay.naming or "hf"
    if naming not in ("hf", "fused"):
        raise InvalidArgument(f"layout.naming: must be 'hf' or 'fused', got {lay.naming!r}")
    dtype = _DTYPES.get(lay.dtype)
    if dtype is None:
        raise InvalidArgument(
            f"layout.dtype: weights can be float32, bfloat16 or float16, got enum {lay.dtype}"
        )
    if len(req.ranks) != tp:
        raise InvalidArgument(f"ranks: tensor_parallel={tp} needs {tp} ranks, got {len(req.ranks)}")
    if sorted(r.rank for r in req.ranks) != list(range(tp)):
        raise InvalidArgument(f"ranks.rank: must be 0..{tp - 1} once each, got {[r.rank for r in req.ranks]}")
    for i, r in enumerate(req.ranks):
        if not r.address:
            raise InvalidArgument(f"ranks[{i}].address: must not be empty")
    if req.every_k_versions < 0:
        raise InvalidArgument(f"every_k_versions: must be >= 0, got {req.every_k_versions}")
    endpoints = sorted(
        (Endpoint(r.address, r.rank, req.deployment, r.same_host) for r in req.ranks), key=lambda e: e.rank
    )
    return Target(
        deployment=req.deployment, layout=Layout(tp, naming, dtype), endpoints=endpoints,
        every_k=max(1, req.every_k_versions), canary=req.canary, run_id=req.run_id, registration=req,
    )  # fmt: skip


def kv_key(prefix: str, name: str) -> str:
    """KV keys allow letters, digits, '-', '_', '/', '=', '.'; everything else becomes '_'."""
    return f"{prefix}.{re.sub(r'[^A-Za-z0-9_=/-]', '_', name)}"
