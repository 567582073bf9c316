"""An inference replica end to end: no weights -> not ready; weights staged over its own gRPC server
(config in the first bucket, checksums verified), committed atomically; generate over gRPC and Ray."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.replica import ReplicaCore
from services.kit.config.recipe import DeploymentSpec
from services.kit.messages.codec import TORCH_TO_PROTO, tensor_to_bytes
from services.kit.rpc import errors
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.weights.checksum import hash64

CONFIG = ModelConfig.tiny(vocab_size=61, max_position_embeddings=64)


def buckets(
    model: Qwen2ForCausalLM,
    layout: Layout,
    rank: int,
    version: int,
    n_buckets: int = 2,
    corrupt: bool = False,
):
    shard = shard_state_dict(model.hf_state_dict(), CONFIG, layout, rank)
    names = list(shard)
    out = []
    for b in range(n_buckets):
        slices = []
        for name in names[b::n_buckets]:
            t = shard[name]
            flat = t.reshape(-1)
            half = flat.numel() // 2  # two slices per tensor: offsets matter
            for off, part in ((0, flat[:half]), (half, flat[half:])):
                data = tensor_to_bytes(part)
                slices.append(
                    inference_pb2.WeightSlice(
                        name=name,
                        dtype=TORCH_TO_PROTO[t.dtype],
                        shape=list(t.shape),
                        offset=off,
                        data=data,
                        hash64=hash64(data),
                    )
                )
        if corrupt and b == n_buckets - 1:
            raw = bytearray(slices[-1].data)
            raw[0] ^= 0xFF
            slices[-1].data = bytes(raw)
        out.append(
            inference_pb2.StageWeightsRequest(
                version=version,
                slices=slices,
                bucket_count=n_buckets,
                bucket_index=b,
                rank=rank,
                model_config_json=json.dumps(CONFIG.to_hf_dict()) if b == 0 else "",
            )
        )
    return out


def request(prompt, max_tokens=6, temperature=0.9, seed=5, n=1) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n),
        request_id="r1",
    )


def assert_parity(model: Qwen2ForCausalLM, prompt: list[int], completion, temperature: float) -> None:
    ids = torch.tensor(prompt + list(completion.token_ids))
    with torch.no_grad():
        ref = token_logprobs(model(ids), ids, torch.tensor([0, len(ids)]), temperature)[len(prompt) :]
    assert torch.allclose(torch.tensor(list(completion.logprobs)), ref, atol=1e-4)


async def test_replica_stages_commits_and_serves_over_grpc() -> None:
    core = ReplicaCore(DeploymentSpec(name="dep", max_model_len=48, max_batch_size=4), replica="dep-r0")
    address = await core.start()
    channel = grpc.aio.insecure_channel(address)
    stub = inference_pb2_grpc.InferenceEngineServiceStub(channel)
    v1, v2 = Qwen2ForCausalLM(CONFIG, seed=1).eval(), Qwen2ForCausalLM(CONFIG, seed=2).eval()
    try:
        assert not await core.ready()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(request([1, 2]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # Without a model, the first bucket must carry config.json.
        layout = Layout()
        b = buckets(v1, layout, 0, 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StageWeights(iter([b[1]]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith("model_config_json")
        # Version 1 arrives in two calls; nothing serves until commit.
        reply = await stub.StageWeights(iter([b[0]]))
        assert not reply.complete
        reply = await stub.StageWeights(iter([b[1]]))
        assert reply.complete and reply.serving_version == -1
        assert not await core.ready()
        assert (await stub.CommitWeights(inference_pb2.CommitWeightsRequest(version=1))).weight_version == 1
        assert await core.ready()

        resp = await stub.Generate(request([3, 4, 5]))
        assert resp.replica == "dep-r0" and resp.deployment == "dep" and resp.prompt_tokens == 3
        assert resp.completions[0].weight_version == 1
        assert_parity(v1, [3, 4, 5], resp.completions[0], 0.9)

        # A corrupted byte is caught by the checksum; version 1 keeps serving.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StageWeights(iter(buckets(v2, layout, 0, 2, corrupt=True)))
        assert "hash64" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CommitWeights(inference_pb2.CommitWeightsRequest(version=2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (await stub.Status(inference_pb2.StatusRequest())).weight_version == 1

        # A stale version is refused; the clean retry of version 2 switches.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StageWeights(iter(buckets(v2, layout, 0, 1)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await stub.StageWeights(iter(buckets(v2, layout, 0, 2)))
        await stub.CommitWeights(inference_pb2.CommitWeightsRequest(version=2))
        resp = await stub.Generate(request([3, 4, 5]))
        assert resp.completions[0].weight_version == 2
        assert_parity(v2, [3, 4, 5], resp.completions[0], 0.9)

        # Bad input: INVALID_ARGUMENT naming the field; the replica keeps serving.
        for bad, field in [
            (request([]), "prompt_token_ids"),
            (request([1, 61]), "prompt_token_ids"),
            (request([1], temperature=-1.0), "sampling.temperature"),
            (request([1], max_tokens=48), "sampling.max_tokens"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field), err.value.details()

        # Pause queues requests; resume serves them.
        await stub.Pause(inference_pb2.PauseRequest())
        pending = asyncio.ensure_future(stub.Generate(request([7], n=2)))
        await asyncio.sleep(0.2)
        assert not pending.done() and (await stub.Status(inference_pb2.StatusRequest())).paused
        await stub.Resume(inference_pb2.ResumeRequest())
        assert len((await pending).completions) == 2
    finally:
        await channel.close()
        await core.shutdown()


@pytest.mark.slow
async def test_tp2_replica_actor_receives_per_rank_buckets_and_streams(ray_client) -> None:
    import ray

    from services.inference_router.replica_actor import InferenceReplica

    spec = DeploymentSpec(name="tp2", tensor_parallel=2, max_model_len=48, max_batch_size=4)
    actor = InferenceReplica.options(num_cpus=1).remote(spec=spec, replica="tp2-r0")
    model = Qwen2ForCausalLM(CONFIG, seed=9).eval()
    try:
        status = await actor.status.remote()
        assert status.ready is False and status.layout == "fused"
        assert len(status.rank_addresses) == 2
        channel = grpc.aio.insecure_channel(status.address)
        stub = inference_pb2_grpc.InferenceEngineServiceStub(channel)
        layout = Layout(tp_size=2, naming="fused")
        # Rank 1's buckets first: the config rides in each rank's first bucket.
        for rank in (1, 0):
            await stub.StageWeights(iter(buckets(model, layout, rank, 3)))
        await stub.CommitWeights(inference_pb2.CommitWeightsRequest(version=3))
        status = await actor.status.remote()
        assert status.ready and status.weight_version == 3 and status.vocab_size == CONFIG.vocab_size

        raw = await actor.generate.remote(request([9, 8, 7], max_tokens=5).SerializeToString())
        resp = inference_pb2.GenerateResponse.FromString(raw)
        assert_parity(model, [9, 8, 7], resp.completions[0], 0.9)

        chunks = [
            inference_pb2.GenerateStreamResponse.FromString(await ref)
            async for ref in actor.generate_stream.options(num_returns="streaming").remote(
                request([9, 8, 7], max_tokens=5).SerializeToString()
            )
        ]
        assert [t for c in chunks for t in c.token_ids] == list(resp.completions[0].token_ids)
        assert chunks[-1].finish_reason == "length" and chunks[-1].replica == "tp2-r0"
        await channel.close()
    finally:
        await actor.shutdown.remote()
        ray.kill(actor)


async def test_a_request_sent_ahead_of_its_version_starts_when_the_version_commits() -> None:
    core = ReplicaCore(DeploymentSpec(name="dep", max_model_len=48, max_batch_size=8), replica="dep-r0")
    v1, v2 = Qwen2ForCausalLM(CONFIG, seed=1).eval(), Qwen2ForCausalLM(CONFIG, seed=2).eval()
    try:
        await core.load_state_dict(1, v1.hf_state_dict(), CONFIG)
        assert (await core.status()).holds_for_version

        def ahead(prompt: list[int], wait_ms: int) -> inference_pb2.GenerateRequest:
            req = request(prompt, n=2)
            req.min_weight_version, req.version_wait_ms = 2, wait_ms
            return req

        held = [asyncio.ensure_future(core.generate_proto(ahead([3, 4, i], 10_000))) for i in (5, 6, 7)]
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in held)  # version 1 serves; nothing sampled under it
        steps = core.engine.steps
        await core.load_state_dict(2, v2.hf_state_dict())
        for task, last in zip(held, (5, 6, 7), strict=True):
            completions = (await task).completions
            assert [c.weight_version for c in completions] == [2, 2]
            assert_parity(v2, [3, 4, last], completions[0], 0.9)
        # All prefilled in the commit's first step: 6 tokens each in 5 steps (the first samples two).
        assert core.engine.steps - steps == 5

        # Held as long as allowed for a version that never comes: FAILED_PRECONDITION naming the field.
        req = ahead([3], 100)
        req.min_weight_version = 3
        with pytest.raises(
            errors.FailedPrecondition, match=r"^min_weight_version: .* still serves version 2"
        ):
            await core.generate_proto(req)
        # Without a wait the request is served at once, as before.
        assert (await core.generate_proto(request([3]))).completions[0].weight_version == 2
    finally:
        await core.shutdown()


async def test_a_canary_replica_does_not_hold_requests_for_a_version_it_has_not_checked() -> None:
    core = ReplicaCore(DeploymentSpec(name="dep", max_model_len=48, canary=True), replica="dep-r0")
    try:
        await core.load_state_dict(1, Qwen2ForCausalLM(CONFIG, seed=1).hf_state_dict(), CONFIG)
        assert not (await core.status()).holds_for_version
        req = request([3, 4])
        req.min_weight_version, req.version_wait_ms = 2, 5_000
        with pytest.raises(errors.FailedPrecondition, match=r"^version_wait_ms: .*canary"):
            await core.generate_proto(req)
    finally:
        await core.shutdown()


async def test_a_replica_asked_to_commit_when_complete_serves_the_version_its_last_bucket_completes() -> None:
    core = ReplicaCore(DeploymentSpec(name="dep", max_model_len=48), replica="dep-r0")
    address = await core.start()
    channel = grpc.aio.insecure_channel(address)
    stub = inference_pb2_grpc.InferenceEngineServiceStub(channel)
    v1, v2 = Qwen2ForCausalLM(CONFIG, seed=1).eval(), Qwen2ForCausalLM(CONFIG, seed=2).eval()
    try:
        for version, model, corrupt in ((1, v1, False), (2, v2, True), (2, v2, False)):
            sent = buckets(model, Layout(), 0, version, corrupt=corrupt)
            for b in sent:
                b.commit_when_complete = True
            first = await stub.StageWeights(iter(sent[:1]))
            assert not first.complete and first.serving_version == (-1 if version == 1 else 1)
            if corrupt:  # a bucket that fails its check commits nothing: version 1 keeps serving
                with pytest.raises(grpc.aio.AioRpcError, match="hash64"):
                    await stub.StageWeights(iter(sent[1:]))
                await stub.AbortWeights(inference_pb2.AbortWeightsRequest(version=version))
                assert (await stub.Status(inference_pb2.StatusRequest())).weight_version == 1
                continue
            last = await stub.StageWeights(iter(sent[1:]))
            assert last.complete and last.serving_version == version  # no CommitWeights
            resp = await stub.Generate(request([3, 4, 5]))
            assert resp.completions[0].weight_version == version
            assert_parity(model, [3, 4, 5], resp.completions[0], 0.9)
    finally:
        await channel.close()
        await core.shutdown()


async def test_a_replica_of_two_ranks_refuses_to_commit_on_one_ranks_bucket() -> None:
    core = ReplicaCore(DeploymentSpec(name="dep", max_model_len=48, tensor_parallel=2), replica="dep-r0")
    try:
        [bucket, *_] = buckets(Qwen2ForCausalLM(CONFIG, seed=1), Layout(2, "fused"), 0, 1)
        bucket.commit_when_complete = True
        with pytest.raises(errors.InvalidArgument, match=r"^commit_when_complete: a replica of 2 ranks"):
            await core.stage_weights(bucket)
        assert core.engine is None  # refused before anything was built
    finally:
        await core.shutdown()
