"""The weight lifecycle of a tp=1 CPU replica (LocalWeights): a version is served only once it is
staged complete and committed, a rejected version rolls back to the one before it, an aborted
staging leaves the served weights alone, and the versions it reports say which is which."""

from __future__ import annotations

import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.inference_router.weights import LocalWeights, WeightVersions
from services.kit.rpc import errors
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.weights import IncompleteVersion, WeightStager, tensors_bucket

CONFIG = ModelConfig.tiny()
F32 = common_pb2.DType.D_TYPE_FLOAT32


def state(seed: int) -> dict[str, torch.Tensor]:
    model = Qwen2ForCausalLM(CONFIG, seed=None)
    model.init_weights(seed, std=0.1)
    return {k: v.detach().clone() for k, v in model.hf_state_dict().items()}


def stage_requests(version: int, tensors: dict[str, torch.Tensor]) -> list[inference_pb2.StageWeightsRequest]:
    """One request per tensor (the stager needs each parameter it holds exactly once)."""
    out = []
    for name, t in tensors.items():
        bucket = tensors_bucket(0, 1, {name: t}, F32)
        payload = bytes(bucket.payload)
        slices = [s.to_proto(data=payload[s.byte_start : s.byte_start + s.nbytes]) for s in bucket.slices]
        out.append(inference_pb2.StageWeightsRequest(version=version, rank=0, slices=slices))
    return out


async def greedy_tokens(engine: CPUEngine) -> list[int]:
    request = EngineRequest([1, 5, 9, 13], SamplingParams(temperature=0.0, max_tokens=6))
    (result,) = await engine.generate([request])
    return result.completions[0].token_ids


@pytest.fixture
async def replica():
    layout = Layout()
    engine = CPUEngine.create(CONFIG, None, layout=layout).start()
    weights = LocalWeights(engine, WeightStager(rank_params(CONFIG, layout, 0)))
    yield weights
    await engine.close()


async def stage_all(weights: LocalWeights, version: int, tensors: dict[str, torch.Tensor]) -> bool:
    complete = False
    for msg in stage_requests(version, tensors):
        complete = (await weights.stage(msg))["complete"]
    return complete


async def test_a_version_is_served_only_after_a_complete_stage_and_commit(replica):
    await replica.install(0, state(1), CONFIG)
    v0_tokens = await greedy_tokens(replica.engine)
    v1 = state(2)
    names = list(v1)
    for msg in stage_requests(1, {n: v1[n] for n in names[:-1]}):
        await replica.stage(msg)
    assert replica.versions() == WeightVersions(serving=0, staged=1, rollback=-1)
    with pytest.raises(IncompleteVersion, match=names[-1]):
        await replica.commit(1)
    assert replica.versions().serving == 0 and await greedy_tokens(replica.engine) == v0_tokens

    assert await stage_all(replica, 1, {names[-1]: v1[names[-1]]})
    await replica.commit(1)
    assert replica.versions() == WeightVersions(serving=1, staged=-1, rollback=0)
    assert await greedy_tokens(replica.engine) != v0_tokens


async def test_a_rejected_version_rolls_back_to_the_one_before_it(replica):
    await replica.install(0, state(1), CONFIG)
    v0_tokens = await greedy_tokens(replica.engine)
    assert await stage_all(replica, 1, state(2))
    await replica.commit(1)

    assert await replica.rollback(1) == 0
    assert replica.versions().serving == 0 and await greedy_tokens(replica.engine) == v0_tokens
    assert not replica.holds(1)  # a retried rollback finds nothing to undo
    with pytest.raises(errors.FailedPrecondition, match="cannot roll back 1"):
        await replica.rollback(1)


async def test_an_aborted_staging_changes_nothing_served(replica):
    await replica.install(0, state(1), CONFIG)
    v0_tokens = await greedy_tokens(replica.engine)
    v1 = state(2)
    first = next(iter(v1))
    await stage_all(replica, 1, {first: v1[first]})
    await replica.abort(1)
    assert replica.versions() == WeightVersions(serving=0, staged=-1, rollback=-1)
    with pytest.raises(IncompleteVersion):
        await replica.commit(1)
    assert await greedy_tokens(replica.engine) == v0_tokens
