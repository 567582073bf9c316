"""Weights out: each rank turns its OWN FSDP shards into bounded PushShards messages for weight-sync.

Offsets come from the DTensor's layout (``compute_local_shape_and_global_offset``), never from an
even-split assumption: FSDP2's Shard(0) gives the last ranks fewer rows, sometimes none. No rank
gathers the model for this. A tied ``lm_head`` is the same parameter as ``embed_tokens`` and is sent
once, under the embedding's name (``named_parameters`` de-duplicates it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache

import torch
from torch import nn

from looprl.weightsync.v1 import weightsync_pb2
from services.kit.messages.codec import TORCH_TO_PROTO, tensor_from_bytes, tensor_to_bytes, torch_dtype
from services.weights.checksum import hash64

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def local_shards(
    model: nn.Module, trainable_only: bool = False
) -> Iterator[tuple[str, torch.Size, int, torch.Tensor]]:
    """(HF name, global shape, row offset, local rows) for every parameter this rank holds (with
    trainable_only, a LoRA run's adapters: the frozen base never changes, so it is never sent)."""
    from torch.distributed.tensor import DTensor

    if hasattr(model, "reshard"):  # FSDP2 leaves the root unsharded after a forward without backward
        model.reshard()
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        if isinstance(param, DTensor):
            # Under no_grad, to_local skips autograd and detach happens on the plain tensor: a DTensor's
            # own detach goes through sharding propagation, a cost on every step's push.
            with torch.no_grad():
                local = param.to_local().detach()
            local_shape, offset = _layout(tuple(param.shape), param.device_mesh, tuple(param.placements))
            if tuple(local.shape) != local_shape:
                raise RuntimeError(
                    f"{name}: local shard {tuple(local.shape)} disagrees with its layout {local_shape}"
                )
            row_offset = offset[0] if local.dim() > 0 else 0
            yield name, param.shape, row_offset, local
        else:  # an unsharded module (world size 1 without FSDP): the whole tensor is "rank 0's shard"
            yield name, param.shape, 0, param.detach()


@lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], mesh, placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (local shape, global offset) of a DTensor layout. A parameter's layout never
    changes, and working it out is DTensor Python (~0.1 ms a tensor), so it is worked out once."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(n) for n in local_shape), tuple(int(o) for o in offset)


def shard_chunks(
    model: nn.Module,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    dtype: torch.dtype | None = None,
    trainable_only: bool = False,
) -> Iterator[weightsync_pb2.ShardChunk]:
    """ShardChunks of at most ``max_bytes`` of data each (a row is never split)."""
    for name, global_shape, row_offset, local in local_shards(model, trainable_only):
        local = local.to(dtype) if dtype is not None else local
        rows = local.shape[0] if local.dim() > 0 else 1
        row_bytes = max(local[0].numel() * local.element_size(), 1) if local.dim() > 0 and rows else 1
        rows_per_chunk = max(1, max_bytes // row_bytes)
        proto_dtype = TORCH_TO_PROTO[local.dtype]
        if rows == 0:
            yield weightsync_pb2.ShardChunk(
                name=name, dtype=proto_dtype, global_shape=list(global_shape), row_offset=row_offset, rows=0
            )
            continue
        for start in range(0, rows, rows_per_chunk):
            piece = local[start : start + rows_per_chunk] if local.dim() > 0 else local
            data = tensor_to_bytes(piece)
            yield weightsync_pb2.ShardChunk(
                name=name,
                dtype=proto_dtype,
                global_shape=list(global_shape),
                row_offset=row_offset + start,
                rows=piece.shape[0] if local.dim() > 0 else 1,
                data=data,
                hash64=hash64(data),
            )


def push_requests(
    model: nn.Module,
    version: int,
    rank: int,
    world_size: int,
    run_id: str = "",
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    dtype: torch.dtype | None = None,
    model_config_json: str = "",
    trainable_only: bool = False,
) -> Iterator[weightsync_pb2.PushShardsRequest]:
    """This rank's stream for one version: chunks batched into messages of <= max_bytes of data,
    the last message flagged ``last=True`` (sent even when the rank holds nothing). The first
    message carries the HF config.json, which weight-sync needs to map names to target layouts."""
    first = [True]

    def message(chunks: list[weightsync_pb2.ShardChunk], last: bool) -> weightsync_pb2.PushShardsRequest:
        request = weightsync_pb2.PushShardsRequest(
            version=version,
            trainer_rank=rank,
            trainer_world_size=world_size,
            shards=chunks,
            last=last,
            run_id=run_id,
        )
        if first[0]:
            request.model_config_json = model_config_json
            first[0] = False
        return request

    pending: list[weightsync_pb2.ShardChunk] = []
    pending_bytes = 0
    for chunk in shard_chunks(model, max_bytes, dtype, trainable_only):
        if pending and pending_bytes + len(chunk.data) > max_bytes:
            yield message(pending, last=False)
            pending, pending_bytes = [], 0
        pending.append(chunk)
        pending_bytes += len(chunk.data)
    yield message(pending, last=True)


def reassemble(requests: Iterable[weightsync_pb2.PushShardsRequest]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's chunks, checking hash64 and that the rows tile each tensor
    exactly once (what weight-sync must do; used by tests to prove the shards are complete)."""
    tensors: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for request in requests:
        for chunk in request.shards:
            shape = list(chunk.global_shape)
            dtype = torch_dtype(chunk.dtype)
            if chunk.name not in tensors:
                tensors[chunk.name] = torch.empty(shape, dtype=dtype)
                covered[chunk.name] = torch.zeros(shape[0] if shape else 1, dtype=torch.int32)
            if chunk.rows == 0:
                continue
            if hash64(chunk.data) != chunk.hash64:
                raise ValueError(f"{chunk.name}: hash64 mismatch at row {chunk.row_offset}")
            piece_shape = [chunk.rows, *shape[1:]] if shape else []
            piece = tensor_from_bytes(chunk.data, dtype, piece_shape)
            if shape:
                tensors[chunk.name][chunk.row_offset : chunk.row_offset + chunk.rows] = piece
                covered[chunk.name][chunk.row_offset : chunk.row_offset + chunk.rows] += 1
            else:
                tensors[chunk.name].copy_(piece)
                covered[chunk.name] += 1
    for name, count in covered.items():
        if not bool((count == 1).all()):
            raise ValueError(f"{name}: rows not covered exactly once")
    return tensors
