"""Reshard plans: assembled buckets reproduce the modeling reference exactly, move only the bytes
each rank needs, and are computed once."""

from __future__ import annotations

import pytest
import torch

from bench.harness.synthetic_weights import random_state, rank_requests
from looprl.inference.v1 import inference_pb2
from services.kit.rpc.errors import InvalidArgument
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params, rank_params, shard_state_dict
from services.weight_sync.plan import PlanCache, build_deployment_plan
from services.weight_sync.planned_bucket import PlannedBucket
from services.weight_sync.versions import VersionStore
from services.weights import WeightStager
from services.weights.wire import encode_stage_request


def push_all(state, world, version=0, max_message_bytes=4096):
    store = VersionStore(shm=False)
    buf = None
    for rank in range(world):
        for req in rank_requests(
            state, version=version, rank=rank, world=world, max_message_bytes=max_message_bytes
        ):
            buf = store.buffer_for(req)
            for i, chunk in enumerate(req.shards):
                buf.add_chunk(rank, chunk, i)
            if req.last:
                buf.ranks_done.add(rank)
    assert buf is not None and buf.complete
    return buf


def deliver_in_process(plan_rank, buf, stager, version, parts=False):
    """`parts`: the gRPC sender's way (contiguous slices hashed and sent from the chunks themselves,
    the rest copied into scratch); else every slice copied into the bucket buffer by `fill`."""
    for spec in plan_rank.buckets:
        bucket = PlannedBucket(spec, plan_rank.dtype, buf.chunks)
        payload = memoryview(bytearray(bucket.nbytes))
        slice_data = bucket.payload_parts(payload) if parts else bucket.fill(payload)
        wire = encode_stage_request(
            bucket, payload, version=version, rank=plan_rank.rank, slice_data=slice_data
        )
        stager.stage(inference_pb2.StageWeightsRequest.FromString(wire))
    return stager.commit(version)


@pytest.mark.parametrize(
    "layout,world",
    [
        (Layout(1, "hf", "float32"), 2),
        (Layout(2, "fused", "float32"), 2),
        (Layout(2, "hf", "bfloat16"), 3),
        (Layout(4, "fused", "float32"), 3),  # tp > kv heads: kv heads replicated
    ],
)
@pytest.mark.parametrize("parts", [False, True], ids=["fill", "parts"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "lora"])
def test_planned_buckets_rebuild_every_rank_exactly(layout, world, parts, family):
    from services.modeling.lora import TARGETS, LoraSpec

    make = ModelConfig.tiny_qwen3 if family == "qwen3" else ModelConfig.tiny
    config = make(tie_word_embeddings=False, vocab_size=37)
    if family == "lora":  # a LoRA run's version: the adapter's tensors, split as the base is
        config = config.with_lora(LoraSpec(4, 8.0, TARGETS))
    state = random_state(config)
    buf = push_all(state, world)
    plan = build_deployment_plan(buf.layout(), config, layout, bucket_bytes=3000)
    for rank_plan in plan.ranks:
        stager = WeightStager(rank_params(config, layout, rank_plan.rank), rank=rank_plan.rank)
        got = deliver_in_process(rank_plan, buf, stager, version=0, parts=parts)
        want = shard_state_dict(state, config, layout, rank_plan.rank)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_tp2_moves_the_model_once_plus_only_replicated_params():
    config = ModelConfig.tiny(tie_word_embeddings=True)
    state = random_state(config)
    buf = push_all(state, 2)
    model_bytes = sum(t.numel() * 4 for t in state.values())
    tp1 = build_deployment_plan(buf.layout(), config, Layout(1, "hf"), 1 << 16)
    tp2 = build_deployment_plan(buf.layout(), config, Layout(2, "fused"), 1 << 16)
    assert tp1.nbytes == model_bytes
    replicated = sum(state[n].numel() * 4 for n in hf_params(config) if "norm" in n)
    assert tp2.nbytes == model_bytes + replicated  # each rank its slice; only the norms go to both ranks
    assert tp2.replicated_bytes == replicated
    per_rank = [sum(p.nbytes for p in rank_params(config, Layout(2, "fused"), r)) for r in range(2)]
    assert [r.nbytes for r in tp2.ranks] == per_rank


def test_buckets_respect_the_size_and_plans_are_cached():
    config = ModelConfig.tiny()
    state = random_state(config)
    buf = push_all(state, 2)
    cache = PlanCache()
    plan = cache.get(buf.layout(), config, Layout(2, "fused"), 2048)
    assert cache.get(buf.layout(), config, Layout(2, "fused"), 2048) is plan
    assert cache.computed == 1
    for rank_plan in plan.ranks:
        assert len(rank_plan.buckets) > 3
        assert all(b.nbytes <= 2048 for b in rank_plan.buckets)


def test_trainer_layout_rejects_gaps_between_rank_shards():
    config = ModelConfig.tiny()
    state = random_state(config)
    store = VersionStore(shm=False)
    reqs = list(rank_requests(state, version=0, rank=0, world=2))
    buf = None
    for req in reqs:
        buf = store.buffer_for(req)
        for i, c in enumerate(req.shards):
            buf.add_chunk(0, c, i)
    with pytest.raises(InvalidArgument, match="covers"):
        buf.layout()


@pytest.mark.parametrize("layout", [Layout(1, "hf"), Layout(2, "fused")])
def test_a_byte_flipped_after_hashing_slices_in_place_is_caught(layout):
    """Slices sent straight from the chunks are hashed where they sit; one byte changed on the way
    (here: in the encoded message) still fails verification and nothing is staged."""
    from services.weights.errors import ChecksumMismatch

    config = ModelConfig.tiny(tie_word_embeddings=False, vocab_size=37)
    buf = push_all(random_state(config), 2)
    rank_plan = build_deployment_plan(buf.layout(), config, layout, bucket_bytes=1 << 20).ranks[0]
    bucket = PlannedBucket(rank_plan.buckets[0], rank_plan.dtype, buf.chunks)
    payload = memoryview(bytearray(bucket.nbytes))
    wire = bytearray(
        encode_stage_request(bucket, payload, version=0, slice_data=bucket.payload_parts(payload))
    )
    wire[len(wire) - 3] ^= 0x01  # inside the last slice's payload
    stager = WeightStager(rank_params(config, layout, 0), rank=0)
    with pytest.raises(ChecksumMismatch):
        stager.stage(inference_pb2.StageWeightsRequest.FromString(bytes(wire)))
    assert stager.staged_version is None and stager.bytes_staged == 0
