"""A replica serving LoRA runs: it loads the base once from model_path, receives each run's adapter
versions through weight-sync's own plan and buckets (StageWeightsRequest.adapter naming the run),
and serves each run's requests with that run's adapter at that run's version, beside the others."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.replica import ReplicaCore
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc import errors
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout
from services.modeling.logprobs import token_logprobs
from services.modeling.lora import LoraSpec, inject
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.trainer.shards import push_requests
from services.weight_sync.plan import build_deployment_plan
from services.weight_sync.planned_bucket import PlannedBucket
from services.weight_sync.versions import VersionStore
from services.weights.wire import encode_stage_request

CONFIG = ModelConfig.tiny(vocab_size=61, max_position_embeddings=64)
SPEC = LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj"))
PROMPT = [3, 14, 15, 9, 26]


def policy(seed: int) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(CONFIG, seed=1).eval()
    inject(model, SPEC, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + len(name)))
    return model


def adapter_buckets(model: Qwen2ForCausalLM, run: str, version: int) -> list[bytes]:
    """What weight-sync sends a tp=1 replica for one adapter version of `run`: the trainer's pushes,
    ingested, planned and bucketed by weight-sync's own code."""
    config_json = json.dumps(CONFIG.with_lora(SPEC).to_hf_dict())
    store, buf = VersionStore(shm=False), None
    for req in push_requests(model, version, 0, 1, run, 4096, None, config_json, True):
        buf = store.buffer_for(req)
        for i, chunk in enumerate(req.shards):
            buf.add_chunk(0, chunk, i)
        if req.last:
            buf.ranks_done.add(0)
    plan = build_deployment_plan(buf.layout(), CONFIG.with_lora(SPEC), Layout(1, "hf"), bucket_bytes=2048)
    [rank_plan] = plan.ranks
    out = []
    for spec in rank_plan.buckets:
        bucket = PlannedBucket(spec, rank_plan.dtype, buf.chunks)
        payload = memoryview(bytearray(bucket.nbytes))
        out.append(
            encode_stage_request(
                bucket,
                payload,
                version=version,
                slice_data=bucket.fill(payload),
                model_config_json=config_json if spec.index == 0 else "",
                adapter=run,
            )
        )
    return out


def request(run: str, seed: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=seed, n=2),
        run_id=run,
    )


@pytest.fixture
def base_dir(tmp_path):
    Qwen2ForCausalLM(CONFIG, seed=1).save_pretrained(tmp_path)
    return tmp_path


async def test_one_replica_serves_two_runs_adapters_each_at_its_own_version(base_dir) -> None:
    spec = DeploymentSpec(name="shared/lora", model_path=str(base_dir), max_loras=2, max_model_len=48)
    core = ReplicaCore(spec, replica="shared/lora-r0")
    await core.start()
    try:
        assert (await core.status()).weight_version == 0  # the base, loaded once
        assert (await core.status("run-a")).weight_version == -1  # nothing of run-a yet
        with pytest.raises(errors.FailedPrecondition, match="run-a"):
            await core.generate_proto(request("run-a", 1))
        with pytest.raises(errors.InvalidArgument, match="run_id"):
            await core.generate_proto(request("", 1))

        runs = {"run-a": (policy(7), 3), "run-b": (policy(8), 5)}
        for run, (model, version) in runs.items():
            for wire in adapter_buckets(model, run, version):
                out = await core.stage_weights(wire)
            assert out["complete"]
            assert await core.commit_weights(version, run) == version
        status = await core.status()
        assert status.adapter_versions == {"run-a": 3, "run-b": 5}
        assert (await core.status("run-b")).weight_version == 5

        for run, (model, version) in runs.items():
            response = await core.generate_proto(request(run, 11))
            assert response.adapter == run
            for completion in response.completions:
                assert completion.weight_version == version
                ids = torch.tensor(PROMPT + list(completion.token_ids))
                with torch.no_grad():
                    ref = token_logprobs(model(ids), ids, torch.tensor([0, len(ids)]))[len(PROMPT) :]
                torch.testing.assert_close(torch.tensor(list(completion.logprobs)), ref, atol=1e-4, rtol=0)

        # A third run finds no slot; a run that ended frees its slot for it.
        with pytest.raises(errors.ResourceExhausted, match="max_loras"):
            await core.stage_weights(adapter_buckets(policy(9), "run-c", 0)[0])
        await core.drop_adapter("run-a")
        assert (await core.status()).adapter_versions == {"run-b": 5}
        for wire in adapter_buckets(policy(9), "run-c", 0):
            await core.stage_weights(wire)
        assert await core.commit_weights(0, "run-c") == 0
        # an adapter of another base is refused, naming the field
        other = CONFIG.replace(hidden_size=32, head_dim=8).with_lora(SPEC)
        bad = inference_pb2.StageWeightsRequest(
            version=0, adapter="run-d", model_config_json=json.dumps(other.to_hf_dict()), bucket_count=1
        )
        with pytest.raises(errors.InvalidArgument, match="adapter"):
            await core.stage_weights(bad)
    finally:
        await core.shutdown()


async def test_weight_sync_delivers_each_runs_adapter_versions_to_one_shared_replica(base_dir) -> None:
    from looprl.weightsync.v1 import weightsync_pb2
    from tests.integration.weight_sync.test_weightsync_service import Harness

    spec = DeploymentSpec(name="shared/lora", model_path=str(base_dir), max_loras=2, max_model_len=48)
    core = ReplicaCore(spec, replica="shared/lora-r0")
    address = await core.start()
    sync = await Harness().start()
    try:
        runs = {"run-a": policy(7), "run-b": policy(8)}
        for run in runs:  # one target per (replica, run), both at the shared replica's address
            await sync.stub.RegisterTarget(
                weightsync_pb2.RegisterTargetRequest(
                    deployment=f"{run}/lora-r0",
                    run_id=run,
                    adapter=run,
                    every_k_versions=1,
                    layout=weightsync_pb2.TargetLayout(
                        tensor_parallel=1, naming="hf", dtype=common_pb2.D_TYPE_FLOAT32
                    ),
                    ranks=[weightsync_pb2.TargetRank(rank=0, address=address)],
                )
            )
        config_json = json.dumps(CONFIG.with_lora(SPEC).to_hf_dict())
        for version in (0, 1):
            for run, model in runs.items():
                requests = push_requests(model, version, 0, 1, run, 4096, None, config_json, True)
                reply = await sync.stub.PushShards(iter(list(requests)))
                assert reply.version_complete
        deadline = asyncio.get_running_loop().time() + 20
        while (await core.status()).adapter_versions != {"run-a": 1, "run-b": 1}:
            assert asyncio.get_running_loop().time() < deadline, (await core.status()).adapter_versions
            await asyncio.sleep(0.05)
        for run, model in runs.items():
            response = await core.generate_proto(request(run, 3))
            assert response.adapter == run
            for completion in response.completions:
                ids = torch.tensor(PROMPT + list(completion.token_ids))
                with torch.no_grad():
                    ref = token_logprobs(model(ids), ids, torch.tensor([0, len(ids)]))[len(PROMPT) :]
                torch.testing.assert_close(torch.tensor(list(completion.logprobs)), ref, atol=1e-4, rtol=0)
        targets = {
            t.deployment: t for t in (await sync.stub.GetVersion(weightsync_pb2.GetVersionRequest())).targets
        }
        assert {targets[f"{r}/lora-r0"].version for r in runs} == {1}
    finally:
        await sync.stop()
        await core.shutdown()
