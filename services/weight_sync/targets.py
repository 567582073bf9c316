"""Registered targets (inference deployments): layout, replicas and their rank endpoints, policy
(every k versions, canary), the transport that reaches them (transport/factory.py) and sync state."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from looprl.common.v1 import common_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.rpc.errors import InvalidArgument
from services.modeling.layouts import Layout
from services.weight_sync.transport import Endpoint
from services.weight_sync.transport.factory import KINDS

_DTYPES = {
    common_pb2.DType.D_TYPE_FLOAT32: "float32",
    common_pb2.DType.D_TYPE_BFLOAT16: "bfloat16",
    common_pb2.DType.D_TYPE_FLOAT16: "float16",
    common_pb2.DType.D_TYPE_UNSPECIFIED: "float32",
}


@dataclass
class CanarySettings:
    """Golden prompts and the drift bound a canary is checked against (canary.py)."""

    prompts: list[list[int]] = field(default_factory=list)  # empty: derived from the vocabulary
    tokens_per_prompt: int = 0  # 0: the deliverer's default
    max_logprob_drift: float = 0.0  # 0: the deliverer's default


@dataclass
class Target:
    deployment: str
    layout: Layout
    endpoints: list[Endpoint]  # every rank of every replica, replica by replica
    every_k: int = 1
    canary: bool = False
    canary_settings: CanarySettings = field(default_factory=CanarySettings)
    run_id: str = ""
    transport: str = "auto"  # weight_transport: a kind of transport/factory.py
    registration: weightsync_pb2.RegisterTargetRequest | None = None
    version: int = -1
    state: str = "registered"  # registered | syncing | ready | failed
    last_error: str = ""
    last_bytes: int = 0
    last_sync_seconds: float = 0.0
    attempts: dict[int, int] = field(default_factory=dict)
    canary_drift: float = 0.0
    canary_rejected_version: int = -1
    removed: bool = False  # unregistered: a delivery still in flight to it is abandoned

    def receives(self, run_id: str) -> bool:
        """Whether versions of `run_id` are for this target (a target of no run takes any run's)."""
        return not self.run_id or self.run_id == run_id

    @property
    def replicas(self) -> list[list[Endpoint]]:
        """Endpoints grouped by replica (each the layout's tp ranks, rank order)."""
        tp = self.layout.tp_size
        return [self.endpoints[i : i + tp] for i in range(0, len(self.endpoints), tp)]

    def due(self, version: int) -> bool:
        """Policy: every k-th version (version 0, the initial weights, always; and never backwards)."""
        if version <= self.version:
            return False
        return self.version < 0 or version - self.version >= self.every_k or version % self.every_k == 0

    def to_proto(self) -> weightsync_pb2.TargetVersion:
        return weightsync_pb2.TargetVersion(
            deployment=self.deployment,
            version=self.version,
            state=self.state,
            last_error=self.last_error,
            last_bytes=self.last_bytes,
            last_sync_seconds=self.last_sync_seconds,
            canary_drift=self.canary_drift,
            canary_rejected_version=self.canary_rejected_version,
            run_id=self.run_id,
        )


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
    if not req.ranks or len(req.ranks) % tp:
        raise InvalidArgument(
            f"ranks: tensor_parallel={tp} needs {tp} ranks per replica, got {len(req.ranks)} ranks"
        )
    for i, r in enumerate(req.ranks):
        if not r.address:
            raise InvalidArgument(f"ranks[{i}].address: must not be empty")
    named = [bool(r.replica) for r in req.ranks]
    if any(named) and not all(named):
        raise InvalidArgument("ranks.replica: name the replica of every rank, or of none")
    groups: dict[str, list] = {}
    for i, r in enumerate(req.ranks):
        groups.setdefault(r.replica or f"replica-{i // tp}", []).append(r)
    endpoints = []
    for name, ranks in groups.items():
        if sorted(r.rank for r in ranks) != list(range(tp)):
            raise InvalidArgument(
                f"ranks.rank: replica {name} must list ranks 0..{tp - 1} once each, got {[r.rank for r in ranks]}"
            )
        endpoints += sorted(
            (Endpoint(r.address, r.rank, req.deployment, r.host_id, name, req.adapter) for r in ranks),
            key=lambda e: e.rank,
        )
    transport = req.weight_transport or "auto"
    if transport not in KINDS:
        raise InvalidArgument(f"weight_transport: unknown transport {transport!r} ({', '.join(KINDS)})")
    if req.every_k_versions < 0:
        raise InvalidArgument(f"every_k_versions: must be >= 0, got {req.every_k_versions}")
    policy = req.canary_policy
    prompts = [list(p.token_ids) for p in policy.prompts]
    for i, prompt in enumerate(prompts):
        if not prompt or min(prompt) < 0:
            raise InvalidArgument(f"canary_policy.prompts[{i}].token_ids: must be non-empty token ids >= 0")
    if policy.tokens_per_prompt < 0:
        raise InvalidArgument(
            f"canary_policy.tokens_per_prompt: must be >= 0, got {policy.tokens_per_prompt}"
        )
    if not policy.max_logprob_drift >= 0:  # also rejects NaN
        raise InvalidArgument(
            f"canary_policy.max_logprob_drift: must be >= 0, got {policy.max_logprob_drift}"
        )
    return Target(
        deployment=req.deployment,
        layout=Layout(tp, naming, dtype),
        endpoints=endpoints,
        every_k=max(1, req.every_k_versions),
        canary=req.canary,
        run_id=req.run_id,
        registration=req,
        transport=transport,
        canary_settings=CanarySettings(prompts, policy.tokens_per_prompt, float(policy.max_logprob_drift)),
    )


def kv_key(prefix: str, name: str) -> str:
    """KV keys allow letters, digits, '-', '_', '/', '=', '.'; everything else becomes '_'."""
    return f"{prefix}.{re.sub(r'[^A-Za-z0-9_=/-]', '_', name)}"
