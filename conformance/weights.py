"""Weight versions the kit sends: a model's parameters (Hugging Face Qwen2 names, from a config.json)
filled with seeded random values, as an engine's StageWeights buckets or a trainer's PushShards
stream, each slice and chunk carrying its XXH3-64 `hash64` as the contract requires.

The model is `--option model_config=PATH` (a Hugging Face config.json) or looprl's tiny preset,
the default recipe's model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params, rank_params
from services.weights.checksum import hash64


@dataclass(frozen=True)
class Model:
    config: ModelConfig

    @classmethod
    def from_option(cls, path: str) -> Model:
        if not path:
            return cls(ModelConfig.tiny())
        return cls(ModelConfig.from_hf_dict(json.loads(Path(path).read_text())))

    @property
    def config_json(self) -> str:
        return json.dumps(self.config.to_hf_dict())

    def receiver_params(self) -> list[tuple[str, tuple[int, ...]]]:
        """What a one-rank engine in Hugging Face naming receives (a tied lm_head is not sent)."""
        return [(p.name, tuple(p.shape)) for p in rank_params(self.config, Layout(1, "hf"), 0)]

    def state(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            name: (rng.standard_normal(shape) * 0.1).astype("<f4") for name, shape in self.receiver_params()
        }


def stage_requests(
    model: Model,
    version: int,
    *,
    seed: int | None = None,
    buckets: int = 2,
    rank: int = 0,
    corrupt: bool = False,
    checksums: bool = True,
    commit_when_complete: bool = False,
) -> list[inference_pb2.StageWeightsRequest]:
    """A whole version for a one-rank engine in `buckets` StageWeights messages; every parameter
    is sent as two slices (so offsets matter). `corrupt` flips a byte of the last slice after its
    hash64 was taken; `checksums=False` sends slices that carry neither hash64 nor sum64."""
    state = model.state(version if seed is None else seed)
    names = list(state)
    out = []
    for b in range(buckets):
        slices = []
        for name in names[b::buckets]:
            flat = state[name].reshape(-1)
            half = flat.size // 2
            for offset, part in ((0, flat[:half]), (half, flat[half:])):
                if part.size == 0:
                    continue
                data = part.tobytes()
                piece = inference_pb2.WeightSlice(
                    name=name,
                    dtype=common_pb2.D_TYPE_FLOAT32,
                    shape=list(state[name].shape),
                    offset=offset,
                    data=data,
                    nbytes=len(data),
                )
                if checksums:
                    piece.hash64 = hash64(data)
                slices.append(piece)
        if corrupt and b == buckets - 1:
            raw = bytearray(slices[-1].data)
            raw[len(raw) // 2] ^= 0x5A
            slices[-1].data = bytes(raw)
        out.append(
            inference_pb2.StageWeightsRequest(
                version=version,
                slices=slices,
                bucket_count=buckets,
                bucket_index=b,
                model_config_json=model.config_json if b == 0 else "",
                rank=rank,
                total_bytes=sum(a.nbytes for a in state.values()),
                commit_when_complete=commit_when_complete,
            )
        )
    return out


def push_requests(
    model: Model,
    version: int,
    run_id: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    corrupt: bool = False,
    checksums: bool = True,
) -> list[weightsync_pb2.PushShardsRequest]:
    """One trainer rank's PushShards stream of a version: its dim-0 rows of every parameter (FSDP
    Shard(0): ceil(rows / world) per rank, the last ranks may hold fewer)."""
    state = model.state(version)
    chunks = []
    for name, shape in hf_params(model.config).items():
        full = state.get(name)
        if full is None:
            continue  # a tied lm_head: the trainer never sends it
        per = -(-shape[0] // world_size)
        start, stop = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        data = full[start:stop].tobytes()
        chunk = weightsync_pb2.ShardChunk(
            name=name,
            dtype=common_pb2.D_TYPE_FLOAT32,
            global_shape=list(shape),
            row_offset=start,
            rows=stop - start,
            data=data,
        )
        if checksums:
            chunk.hash64 = hash64(data)
        chunks.append(chunk)
    if corrupt:
        raw = bytearray(chunks[-1].data)
        raw[len(raw) // 2] ^= 0x5A
        chunks[-1].data = bytes(raw)
    half = len(chunks) // 2
    return [
        weightsync_pb2.PushShardsRequest(
            version=version,
            trainer_rank=rank,
            trainer_world_size=world_size,
            shards=part,
            last=last,
            run_id=run_id,
            model_config_json=model.config_json if first else "",
        )
        for part, last, first in ((chunks[:half], False, True), (chunks[half:], True, False))
    ]
