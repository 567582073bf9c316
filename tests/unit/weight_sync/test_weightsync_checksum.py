"""hash64 (the slice checksum) and the zero-copy decoding of StageWeights requests: every single
corrupted byte is caught, moved ranges are caught, incremental == one-shot, and a decoded request
stages exactly like a parsed one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.weights import InvalidWeights, WeightStager, copy_and_hash64, hash64, tensors_bucket
from services.weights.checksum import BLOCK_BYTES, Hasher64
from services.weights.wire import decode_stage_request, encode_stage_request

F32 = common_pb2.DType.D_TYPE_FLOAT32


def test_every_single_byte_change_is_caught():
    data = np.random.default_rng(0).integers(0, 256, 203, dtype=np.uint8)  # not a multiple of 8
    base = hash64(data)
    for i in range(data.size):
        for delta in (1, 128, 255):
            bad = data.copy()
            bad[i] = (int(bad[i]) + delta) % 256
            assert hash64(bad) != base, (i, delta)


def test_moved_ranges_and_lengths_change_the_hash():
    data = np.random.default_rng(1).integers(0, 256, 3 * BLOCK_BYTES + 40, dtype=np.uint8)
    base = hash64(data)
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]  # two words trade places
    assert hash64(swapped) != base
    blocks = data.copy()
    blocks[:BLOCK_BYTES], blocks[BLOCK_BYTES : 2 * BLOCK_BYTES] = (
        data[BLOCK_BYTES : 2 * BLOCK_BYTES],
        data[:BLOCK_BYTES],
    )
    assert hash64(blocks) != base
    assert hash64(np.zeros(8, np.uint8)) != hash64(np.zeros(16, np.uint8))  # zero padding is not free


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, BLOCK_BYTES - 3, BLOCK_BYTES, 2 * BLOCK_BYTES + 11])
def test_incremental_copy_and_one_shot_agree(n):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.empty_like(src)
    assert copy_and_hash64(dst, src) == hash64(src) == hash64(bytes(src))
    assert np.array_equal(dst, src)
    h = Hasher64(src)
    for upto in range(0, n + 1, 100_003):
        h.advance(upto)
    assert h.digest() == hash64(src)


def _request(version=3):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(40, 3, generator=g), "b.bias": torch.randn(5, generator=g)}
    bucket = tensors_bucket(0, 1, tensors, F32)
    raw = encode_stage_request(
        bucket, memoryview(bytes(bucket.payload)), version=version, rank=0, model_config_json='{"x": 1}'
    )
    return tensors, raw


def test_decoded_request_matches_protobuf_and_stages():
    tensors, raw = _request()
    parsed = inference_pb2.StageWeightsRequest.FromString(raw)
    decoded = decode_stage_request(raw)
    assert decoded.version == 3 and decoded.model_config_json == '{"x": 1}' and decoded.rank == 0
    assert [s.name for s in decoded.slices] == [s.name for s in parsed.slices]
    for d, p in zip(decoded.slices, parsed.slices, strict=True):
        assert bytes(d.data) == p.data and d.hash64 == p.hash64 and d.HasField("hash64")
        assert isinstance(d.data, memoryview)  # the payload was not copied
    stager = WeightStager({n: torch.empty_like(t) for n, t in tensors.items()})
    assert stager.stage(decoded).complete
    state = stager.commit(3)
    assert all(torch.equal(state[n], tensors[n]) for n in tensors)


def test_decoded_corruption_and_malformed_bytes_are_rejected():
    tensors, raw = _request()
    stager = WeightStager({n: torch.empty_like(t) for n, t in tensors.items()})
    bad = bytearray(raw)
    bad[len(raw) // 2] ^= 0x40  # a payload byte
    with pytest.raises(InvalidWeights, match="hash64"):
        stager.stage(decode_stage_request(bytes(bad)))
    assert stager.staged_version is None
    for broken in (raw[: len(raw) - 3], b"\x12\xff\xff\xff\xff\x0f", b"\x0b"):
        with pytest.raises(InvalidWeights, match="malformed"):
            decode_stage_request(broken)


def test_decoded_push_request_leaves_chunks_in_place_and_matches_protobuf():
    from bench.harness.synthetic_weights import rank_requests
    from services.kit.rpc.errors import InvalidArgument
    from services.weights.wire import decode_push_request

    g = torch.Generator().manual_seed(1)
    state = {"a.weight": torch.randn(6, 4, generator=g), "b.bias": torch.randn(3, generator=g)}
    (req,) = rank_requests(state, version=2, rank=1, world=2, max_message_bytes=1 << 20)
    req.model_config_json = '{"x": 1}'
    raw = req.SerializeToString()
    decoded = decode_push_request(raw)
    assert (decoded.version, decoded.trainer_rank, decoded.trainer_world_size, decoded.last) == (
        req.version,
        req.trainer_rank,
        req.trainer_world_size,
        req.last,
    )
    assert decoded.model_config_json == '{"x": 1}' and len(decoded.shards) == len(req.shards) > 0
    for d, p in zip(decoded.shards, req.shards, strict=True):
        assert isinstance(d.data, memoryview) and bytes(d.data) == p.data  # not copied
        assert (d.name, d.row_offset, d.rows, d.hash64) == (p.name, p.row_offset, p.rows, p.hash64)
        assert d.HasField("hash64") and hash64(d.data) == d.hash64
    with pytest.raises(InvalidArgument, match="PushShardsRequest: malformed"):
        decode_push_request(raw[:-3])
