"""Trainer-side pushes without a trainer: FSDP-style dim-0 shards of a state dict, as the trainer
ranks send them (uneven rows like FSDP2's Shard(0), last ranks possibly empty). Used by tests
and benchmarks (bench/); the real trainer sends the same messages."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from looprl.weightsync.v1 import weightsync_pb2
from services.weights import proto_dtype
from services.weights.checksum import hash64


def fsdp_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2 Shard(0): chunks of ceil(n/world) rows; the last ranks get fewer or none."""
    per = math.ceil(n / world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def rank_requests(
    state: Mapping[str, torch.Tensor],
    *,
    version: int,
    rank: int,
    world: int,
    run_id: str = "",
    max_message_bytes: int = 8 << 20,
    model_config_json: str = "",
) -> Iterator[weightsync_pb2.PushShardsRequest]:
    """The PushShards stream of one trainer rank (chunks split at row boundaries)."""
    pending: list[weightsync_pb2.ShardChunk] = []
    size = 0
    first = True

    def message(last: bool) -> weightsync_pb2.PushShardsRequest:
        nonlocal first
        req = weightsync_pb2.PushShardsRequest(
            version=version,
            trainer_rank=rank,
            trainer_world_size=world,
            shards=pending,
            last=last,
            run_id=run_id,
            model_config_json=model_config_json if first else "",
        )
        first = False
        return req

    for name, tensor in state.items():
        start, stop = fsdp_rows(tensor.shape[0], world, rank)
        local = tensor.detach()[start:stop].contiguous()
        width = math.prod(tensor.shape[1:])
        row_bytes = max(width * local.element_size(), 1)
        step = max(1, max_message_bytes // row_bytes)
        offsets = range(0, max(local.shape[0], 1), step)
        for r in offsets:
            part = local[r : r + step]
            data = part.view(-1).view(torch.uint8).numpy().tobytes() if part.numel() else b""
            pending.append(
                weightsync_pb2.ShardChunk(
                    name=name,
                    dtype=proto_dtype(tensor.dtype),
                    global_shape=list(tensor.shape),
                    row_offset=start + r,
                    rows=part.shape[0],
                    data=data,
                    hash64=hash64(data),
                )
            )
            size += len(data)
            if size >= max_message_bytes:
                yield message(False)
                pending, size = [], 0
    yield message(True)


def random_state(config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named random weights for a ModelConfig (no model object needed)."""
    from services.modeling.layouts import hf_params

    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) * 0.05
        for name, shape in hf_params(config).items()
    }


async def push_version(
    stub,
    state: Mapping[str, torch.Tensor],
    config,
    version: int,
    world: int = 2,
    max_message_bytes: int = 1 << 16,
) -> list[weightsync_pb2.PushShardsResponse]:
    """Push `state` as version `version` from `world` FSDP-style ranks at once, as a trainer would."""
    import asyncio
    import json

    config_json = json.dumps(config.to_hf_dict())

    async def rank(r: int) -> weightsync_pb2.PushShardsResponse:
        requests = rank_requests(
            state,
            version=version,
            rank=r,
            world=world,
            max_message_bytes=max_message_bytes,
            model_config_json=config_json,
        )
        return await stub.PushShards(iter(list(requests)))

    return list(await asyncio.gather(*(rank(r) for r in range(world))))
