"""Workers of a disaggregated deployment as replicas (ReplicaCore in this process, each with its own
gRPC server): the two-phase exchange the router drives, KV over shared memory and over gRPC
(FetchKV), recompute when the KV cannot be had, and refusals that name the field."""

from __future__ import annotations

import json

import grpc
import pytest

from bench.harness.synthetic_weights import random_state
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.replica import ReplicaCore
from services.inference_router.two_phase import DO_REMOTE_DECODE
from services.kit.config.recipe import DeploymentSpec, DisaggregationSection
from services.kit.rpc import errors
from services.modeling.config import ModelConfig

CONFIG = ModelConfig.tiny(vocab_size=97, max_position_embeddings=128)
WEIGHTS = random_state(CONFIG, seed=4)
PROMPT = [4, 8, 15, 16, 23, 42, 7, 9]


def _spec(kv_transfer: str = "auto") -> DeploymentSpec:
    return DeploymentSpec(
        name="pd",
        max_model_len=64,
        disaggregation=DisaggregationSection(prefill_workers=1, decode_workers=1, kv_transfer=kv_transfer),
    )


async def _worker(spec: DeploymentSpec, name: str) -> ReplicaCore:
    core = ReplicaCore(spec, replica=name)
    await core.start()
    await core.load_state_dict(0, WEIGHTS, config=CONFIG)
    return core


def _request(**kw) -> inference_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.8, max_tokens=10, n=2, seed=77)
    return inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling, **kw)


async def _prefill(worker: ReplicaCore) -> dict:
    ask = _request(kv_transfer_params=DO_REMOTE_DECODE)
    ask.sampling.max_tokens, ask.sampling.n = 1, 1
    answer = await worker.generate_proto(ask)
    assert not answer.completions and answer.prompt_tokens == len(PROMPT)
    return json.loads(answer.kv_transfer_params)


@pytest.mark.parametrize("kv_transfer", ["auto", "grpc"])
async def test_a_decode_worker_continues_from_the_prefill_workers_kv(kv_transfer):
    spec = _spec(kv_transfer)
    prefill, decode, colocated = (
        await _worker(spec, "pd-r0"),
        await _worker(spec, "pd-r1"),
        await _worker(DeploymentSpec(name="co", max_model_len=64), "co-r0"),
    )
    try:
        params = await _prefill(prefill)
        assert (
            params["do_remote_prefill"] and params["prefill_replica"] == "pd-r0" and params["kv_version"] == 0
        )
        got = await decode.generate_proto(_request(kv_transfer_params=json.dumps(params)))
        want = await colocated.generate_proto(_request())
        assert got.kv_transfer == ("shm" if kv_transfer == "auto" else "grpc")
        assert got.prefill_replica == "pd-r0"
        assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
        assert [list(c.logprobs) for c in got.completions] == [list(c.logprobs) for c in want.completions]
        assert all(list(c.kv_versions) == list(c.token_versions) == [0] * 10 for c in got.completions)
        assert (await prefill.status()).engine["kv_held"] == 0  # read once, then gone
        # The same params again: the KV was taken, so the decode worker computes the prompt itself.
        again = await decode.generate_proto(_request(kv_transfer_params=json.dumps(params)))
        assert again.kv_transfer == "recompute" and again.prefill_replica == ""
        assert [list(c.token_ids) for c in again.completions] == [list(c.token_ids) for c in want.completions]
    finally:
        for core in (prefill, decode, colocated):
            await core.shutdown()


async def test_a_lost_prefill_worker_costs_a_recompute_not_the_request():
    spec = _spec("grpc")
    prefill, decode = await _worker(spec, "pd-r0"), await _worker(spec, "pd-r1")
    try:
        params = await _prefill(prefill)
        await prefill.shutdown()  # its server is gone before the decode worker fetches
        got = await decode.generate_proto(_request(kv_transfer_params=json.dumps(params)))
        assert got.kv_transfer == "recompute" and len(got.completions) == 2
        assert all(len(c.token_ids) == 10 for c in got.completions)
    finally:
        await decode.shutdown()


async def test_fetch_kv_refuses_what_it_does_not_hold_and_params_name_their_field():
    spec = _spec()
    prefill = await _worker(spec, "pd-r0")
    colocated = await _worker(DeploymentSpec(name="co", max_model_len=64), "co-r0")
    try:
        async with grpc.aio.insecure_channel((await prefill.status()).address) as channel:
            stub = inference_pb2_grpc.InferenceEngineServiceStub(channel)
            for kv_id in ("../../etc/passwd", "looprl-kv-1-" + "0" * 32):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.FetchKV(inference_pb2.FetchKVRequest(kv_id=kv_id), timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.NOT_FOUND and "kv_id" in err.value.details()
        with pytest.raises(errors.InvalidArgument, match="kv_transfer_params: not JSON"):
            await prefill.generate_proto(_request(kv_transfer_params="{nope"))
        with pytest.raises(errors.InvalidArgument, match="kv_transfer_params: must be a JSON object"):
            await prefill.generate_proto(_request(kv_transfer_params="[1]"))
        with pytest.raises(
            errors.FailedPrecondition, match="kv_transfer_params: replica co-r0 is not a worker"
        ):
            await colocated.generate_proto(_request(kv_transfer_params=DO_REMOTE_DECODE))
    finally:
        await prefill.shutdown()
        await colocated.shutdown()
