"""Reshard plans: which bytes of which trainer shard go where, computed once per layout pair.

The trainer side is described by a `TrainerLayout`: for each Hugging Face parameter its full
shape, dtype and the dim-0 chunks the trainer ranks pushed (row offsets taken from what each rank
actually sent, never assumed even). The target side is a `services.modeling.layouts.Layout` and
a TP rank, whose `rank_params` list the parameters it holds as pieces of HF tensors.

A `RankPlan` is the ordered list of copy operations (a rectangle of one trainer chunk -> a
contiguous element range of one target parameter), split into slices of at most `bucket_bytes`
and packed into buckets of about `bucket_bytes`. Only the bytes a rank needs are in its plan:
column-parallel tensors contribute their rank's rows, row-parallel tensors their rank's
columns (a strided view of the chunk, copied once into the bucket), replicated tensors (the RMSNorm
weights; kv heads when tp > kv heads) appear in every rank's plan — that duplication is real traffic and
`DeploymentPlan.replicated_bytes` reports it.

Buckets are assembled straight from the received chunk buffers (planned_bucket.py), so nothing
ever holds a full copy of the model. Plans are cached by (trainer layout signature, model config,
layout, rank, bucket size).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params, rank_params
from services.weights import SliceRef, itemsize, proto_dtype

ChunkKey = tuple[str, int, int]  # (HF name, trainer rank, row_offset)


@dataclass(frozen=True)
class ChunkMeta:
    key: ChunkKey
    rows: int


@dataclass(frozen=True)
class SourceParam:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkMeta, ...]  # sorted by row offset, tiling [0, shape[0])

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer's ranks hold the model: dim-0 chunks per HF parameter."""

    params: Mapping[str, SourceParam]

    @functools.cached_property
    def signature(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.params):
            p = self.params[name]
            h.update(repr((name, p.shape, str(p.dtype), [(c.key, c.rows) for c in p.chunks])).encode())
        return h.hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(math.prod(p.shape) * itemsize(p.dtype) for p in self.params.values())


@dataclass(frozen=True)
class CopyOp:
    """chunk[row0:row0+rows, col0:col0+cols] -> target param elements [dst_offset, +rows*cols)."""

    chunk: ChunkKey
    row0: int
    rows: int
    col0: int
    cols: int
    target: str
    target_shape: tuple[int, ...]
    dst_offset: int
    whole_chunk: bool  # the op is the entire chunk (not split to fit a bucket)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass
class PlannedBucketSpec:
    index: int
    count: int
    ops: list[CopyOp]
    slices: list[SliceRef]  # templates; checksums filled per delivery
    nbytes: int

    @functools.cached_property
    def chunk_keys(self) -> frozenset[ChunkKey]:
        """The trainer chunks the bucket reads (a pipelined delivery waits for them)."""
        return frozenset(op.chunk for op in self.ops)


@dataclass
class RankPlan:
    layout: Layout
    rank: int
    dtype: torch.dtype
    buckets: list[PlannedBucketSpec]
    target_bytes: dict[str, int]  # bytes of each target parameter on this rank

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def chunks_needed(self) -> set[ChunkKey]:
        return {op.chunk for b in self.buckets for op in b.ops}


@dataclass
class DeploymentPlan:
    layout: Layout
    ranks: list[RankPlan]
    model_bytes: int  # the model once, in the target dtype
    replicated_bytes: int = field(default=0)  # extra bytes because some params go to every rank

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)


class PlanError(ValueError):
    """The trainer's parameters do not match the model the target layout describes."""


def pushed_params(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes a trainer may push for `config`: its parameters, and a tied lm_head
    under its own name too (a LoRA run pushes its adapter's tensors only)."""
    expected = dict(hf_params(config))
    if config.tie_word_embeddings and config.lora is None and "model.embed_tokens.weight" in expected:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    return expected


def check_trainer_layout(layout: TrainerLayout, config: ModelConfig) -> None:
    """Every HF parameter of the config is pushed with its shape, and chunks tile its rows."""
    expected = hf_params(config)
    allowed = pushed_params(config)
    for name in layout.params:
        if name not in allowed:
            raise PlanError(f"shards: unknown parameter name {name!r} for this model")
    for name, shape in expected.items():
        p = layout.params.get(name)
        if p is None:
            raise PlanError(f"shards: parameter {name!r} was not pushed by any trainer rank")
        if p.shape != shape:
            raise PlanError(
                f"shards[{name}].global_shape: {list(p.shape)}, the model config says {list(shape)}"
            )


def plan_rank(
    trainer: TrainerLayout, config: ModelConfig, layout: Layout, rank: int, bucket_bytes: int
) -> RankPlan:
    dtype = layout.torch_dtype
    size = itemsize(dtype)
    ops: list[CopyOp] = []
    target_bytes: dict[str, int] = {}
    for param in rank_params(config, layout, rank):
        shape = tuple(param.shape)
        width = math.prod(shape[1:])
        target_bytes[param.name] = param.numel * size
        for piece in param.pieces:
            src = trainer.params[piece.source]
            for chunk in src.chunks:
                offset = chunk.key[2]
                clipped = piece.clip_source_rows(offset, offset + chunk.rows)
                if clipped is None:
                    continue
                ops.extend(_ops_for(clipped, chunk, src, param.name, shape, width))
    max_rows_bytes = bucket_bytes
    slices: list[tuple[CopyOp, int]] = []  # (op split to fit a bucket, byte length)
    for op in ops:
        row_bytes = op.cols * size
        per = max(1, max_rows_bytes // max(row_bytes, 1))
        if op.rows <= per:
            slices.append((op, op.numel * size))
            continue
        for r in range(0, op.rows, per):
            n = min(per, op.rows - r)
            part = CopyOp(
                op.chunk,
                op.row0 + r,
                n,
                op.col0,
                op.cols,
                op.target,
                op.target_shape,
                op.dst_offset + r * op.cols,
                False,
            )
            slices.append((part, part.numel * size))
    groups: list[list[tuple[CopyOp, int]]] = [[]]
    filled = 0
    for op, nbytes in slices:
        if groups[-1] and filled + nbytes > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((op, nbytes))
        filled += nbytes
    pdtype = proto_dtype(dtype)
    buckets = []
    for i, group in enumerate(g for g in groups if g):
        refs, pos = [], 0
        for op, nbytes in group:
            refs.append(SliceRef(op.target, pdtype, op.target_shape, op.dst_offset, pos, nbytes))
            pos += nbytes
        buckets.append(PlannedBucketSpec(i, 0, [op for op, _ in group], refs, pos))
    for b in buckets:
        b.count = len(buckets)
    return RankPlan(layout, rank, dtype, buckets, target_bytes)


def _ops_for(piece, chunk: ChunkMeta, src: SourceParam, target: str, shape, width) -> list[CopyOp]:
    (s0, s1), *src_rest = piece.source_box
    (t0, _t1), *dst_rest = piece.target_box
    if len(src.shape) > 2 and any(b != (0, e) for b, e in zip(src_rest, src.shape[1:], strict=False)):
        raise PlanError(f"{piece.source}: pieces that cut dims beyond 1 are not supported")
    if len(src.shape) <= 2 and src_rest:
        c0, c1 = src_rest[0]
        e0, e1 = dst_rest[0]
    else:
        c0, c1, e0, e1 = 0, src.width, 0, width
    offset = chunk.key[2]
    whole = (
        (s0, s1) == (offset, offset + chunk.rows) and (c0, c1) == (0, src.width) and (e0, e1) == (0, width)
    )
    if (e0, e1) == (0, width):  # contiguous range of the target
        return [CopyOp(chunk.key, s0 - offset, s1 - s0, c0, c1 - c0, target, shape, t0 * width, whole)]
    # A target box narrower than the target: one contiguous range per row.
    return [
        CopyOp(chunk.key, s0 - offset + r, 1, c0, c1 - c0, target, shape, (t0 + r) * width + e0, False)
        for r in range(s1 - s0)
    ]


class PlanCache:
    """Plans computed once per (trainer layout, config, target layout, bucket size)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, DeploymentPlan] = {}
        self._lock = threading.Lock()
        self.computed = 0

    def get(
        self, trainer: TrainerLayout, config: ModelConfig, layout: Layout, bucket_bytes: int
    ) -> DeploymentPlan:
        key = (trainer.signature, json.dumps(config.to_hf_dict(), sort_keys=True), layout, bucket_bytes)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                plan = build_deployment_plan(trainer, config, layout, bucket_bytes)
                self._plans[key] = plan
                self.computed += 1
            return plan


def build_deployment_plan(
    trainer: TrainerLayout, config: ModelConfig, layout: Layout, bucket_bytes: int
) -> DeploymentPlan:
    check_trainer_layout(trainer, config)
    layout.check(config)
    ranks = [plan_rank(trainer, config, layout, r, bucket_bytes) for r in range(layout.tp_size)]
    size = itemsize(layout.torch_dtype)
    model_bytes = sum(math.prod(s) for s in hf_params(config).values()) * size
    total = sum(r.nbytes for r in ranks)
    return DeploymentPlan(layout, ranks, model_bytes, total - model_bytes)
