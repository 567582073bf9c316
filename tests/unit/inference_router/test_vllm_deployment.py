"""A tp=2 vLLM deployment from a recipe: the replica reports both ranks with vLLM's fused layout
and bf16, the router registers both with weight-sync, weight-sync's own plan for that target
stages on the replica, and the commit lands each rank's rectangles in its own vLLM worker.

Real: the recipe parser, ReplicaCore (its gRPC server, stagers, commit), DeploymentManager's
registration request, weight-sync's planner and bucket encoding, vLLM's msgpack and
weight-transfer code (see test_vllm_backend.py). Stand-ins: AsyncLLM (tests/support/vllm_double.py,
signature-checked) where vLLM itself would run, and the weight-sync stub that records the
RegisterTarget request instead of a weight-sync process.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from bench.harness.synthetic_weights import random_state
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.deployments import DeploymentManager
from services.inference_router.engine import vllm_engine
from services.inference_router.policies import DeploymentState, LengthProfile, ReplicaState
from services.inference_router.replica import ReplicaCore
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.router import Router
from services.kit.config.recipe import RecipeError, parse_recipe
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.weight_sync.plan import build_deployment_plan
from services.weight_sync.planned_bucket import PlannedBucket
from services.weights.wire import encode_stage_request
from tests.support.vllm_double import RecordingAsyncLLM
from tests.unit.weight_sync.test_weightsync_plan import push_all

CONFIG = ModelConfig.tiny(vocab_size=96, max_position_embeddings=128)
RECIPE = """
[[deployments]]
name = "long"
backend = "vllm"
tensor_parallel = 2
max_model_len = 128
"""


class _CoreHandle:
    """The router's view of an in-process replica (what RayReplicaHandle returns from the actor)."""

    def __init__(self, core: ReplicaCore) -> None:
        self.core, self.name = core, core.name

    async def status(self, timeout_s: float) -> ReplicaStatus:
        return await self.core.status()


class _RecordingWeightSync:
    def __init__(self) -> None:
        self.requests = []

    async def RegisterTarget(self, request, timeout=None):
        self.requests.append(request)
        return SimpleNamespace(current_version=-1)


def _double_behind_create(monkeypatch, llm: RecordingAsyncLLM, engine_args: list[dict]) -> None:
    """VLLMEngine.create runs for real, with the recording double where vLLM's AsyncLLM would
    start; every AsyncEngineArgs keyword set it builds is appended to `engine_args`."""

    def args_of(**kwargs):
        engine_args.append(kwargs)
        return SimpleNamespace(**kwargs)

    def from_engine_args(args):
        # the double's workers were built for the layout these arguments ask vLLM for
        dtype = next(llm.workers[0].model.parameters()).dtype
        assert (args.tensor_parallel_size, f"torch.{args.dtype}") == (len(llm.workers), str(dtype))
        return llm

    api = SimpleNamespace(
        AsyncEngineArgs=args_of,
        AsyncLLM=SimpleNamespace(from_engine_args=from_engine_args),
        WeightTransferInitRequest=lambda init_info: SimpleNamespace(init_info=init_info),
    )
    monkeypatch.setattr(vllm_engine, "vllm_api", lambda: api)


def test_the_recipes_engine_settings_reach_vllm_and_the_engine(monkeypatch):
    """What a recipe sets for a vllm deployment is what VLLMEngine.create hands vLLM and what the
    engine swaps with: dtype (bf16 when unset), tensor parallelism, eager mode, memory share,
    context length, and the pause mode of every swap."""
    [spec] = parse_recipe(
        RECIPE + 'pause_mode = "abort"\nenforce_eager = true\ngpu_memory_utilization = 0.5\n'
    ).deployments
    llm, passed = RecordingAsyncLLM(CONFIG, Layout(2, "fused", "bfloat16")), []
    _double_behind_create(monkeypatch, llm, passed)

    async def run():
        engine = await vllm_engine.VLLMEngine.create(CONFIG, spec)
        try:
            assert engine.pause_mode == "abort" and engine.max_model_len == 128
            assert engine.layout == Layout(2, "fused", "bfloat16")
            state = random_state(CONFIG, seed=1)
            await engine.swap(1, [shard_state_dict(state, CONFIG, engine.layout, r) for r in range(2)])
        finally:
            await engine.close()

    asyncio.run(run())
    [args] = passed
    assert {k: args[k] for k in ("dtype", "tensor_parallel_size", "enforce_eager")} == {
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "enforce_eager": True,
    }
    assert (args["gpu_memory_utilization"], args["max_model_len"], args["load_format"]) == (0.5, 128, "dummy")
    [pause] = [a for m, a in llm.calls if m == "pause_generation"]
    assert pause == ["abort", False]


def test_recipe_rejects_a_bad_dtype_or_pause_mode_naming_the_field():
    with pytest.raises(RecipeError, match=r"deployments\[0\]\.dtype"):
        parse_recipe(RECIPE + 'dtype = "fp8"\n')
    with pytest.raises(RecipeError, match=r"deployments\[0\]\.pause_mode"):
        parse_recipe(RECIPE + 'pause_mode = "drain"\n')


def test_recipe_rejects_a_bad_gpu_memory_share_naming_the_field():
    with pytest.raises(RecipeError, match=r"deployments\[0\]\.gpu_memory_utilization"):
        parse_recipe(RECIPE + "gpu_memory_utilization = 1.5\n")


def test_gpu_requests_follow_the_deployment_spec():
    [tp2] = parse_recipe(RECIPE).deployments
    one = RECIPE.replace("tensor_parallel = 2", "tensor_parallel = 1")
    [shared] = parse_recipe(one + "gpu_memory_utilization = 0.4\n").deployments
    [cpu] = parse_recipe('[[deployments]]\nname = "c"\nbackend = "cpu"\n').deployments
    assert (tp2.gpus_per_replica, shared.gpus_per_replica, cpu.gpus_per_replica) == (2, 0.4, 0)


def test_tp2_vllm_deployment_registers_both_fused_ranks_and_each_worker_gets_its_own(monkeypatch):
    [spec] = parse_recipe(RECIPE).deployments
    assert spec.gpus_per_replica == 2  # the replica's Ray actor asks for one GPU per TP rank
    layout = Layout(2, "fused", "bfloat16")
    llm = RecordingAsyncLLM(CONFIG, layout)

    _double_behind_create(monkeypatch, llm, [])

    async def run():
        core = ReplicaCore(spec, replica="long-r0")
        await core.start()
        try:
            state = random_state(CONFIG, seed=3)
            # the first bucket carries config.json: the replica builds its engine from it
            buf = push_all(state, world=2)
            status = await core.status()
            assert status.rank_addresses == [status.address] * 2 and status.layout == "fused"
            assert status.dtype == "bfloat16"

            router = Router()
            dep = DeploymentState(
                name="long",
                profile=LengthProfile(),
                max_model_len=128,
                max_outstanding_requests=64,
                backend="vllm",
                tensor_parallel=2,
            )
            dep.replicas.append(ReplicaState(name="long-r0", deployment="long", max_outstanding_requests=16))
            router.add_deployment(dep, [_CoreHandle(core)])
            manager = DeploymentManager(router, RouterConfig(weight_sync_address="recorded"))
            manager._weight_sync = _RecordingWeightSync()
            manager.specs["long"] = spec
            dep.layout, dep.dtype = status.layout, status.dtype
            await manager.register_with_weight_sync(dep, 1)
            [request] = manager._weight_sync.requests
            assert [(r.rank, r.address, r.replica) for r in request.ranks] == [
                (0, status.address, "long-r0"),
                (1, status.address, "long-r0"),
            ]
            assert request.layout.tensor_parallel == 2 and request.layout.naming == "fused"
            assert request.layout.dtype == common_pb2.D_TYPE_BFLOAT16

            # weight-sync's own plan for what was registered, delivered to the rank addresses
            target = Layout(request.layout.tensor_parallel, request.layout.naming, "bfloat16")
            config_json = json.dumps(CONFIG.to_hf_dict())

            async def deliver(buf, version: int) -> None:
                plan = build_deployment_plan(buf.layout(), CONFIG, target, bucket_bytes=4096)
                for rank_plan in plan.ranks:
                    for spec_ in rank_plan.buckets:
                        bucket = PlannedBucket(spec_, rank_plan.dtype, buf.chunks)
                        payload = memoryview(bytearray(bucket.nbytes))
                        slice_data = bucket.fill(payload)
                        wire = encode_stage_request(
                            bucket, payload, version=version, rank=rank_plan.rank, slice_data=slice_data
                        )
                        msg = inference_pb2.StageWeightsRequest.FromString(wire)
                        msg.model_config_json = config_json
                        await core.stage_weights(msg)

            def assert_serves(state) -> None:
                for rank in range(2):
                    want = shard_state_dict(state, CONFIG, target, rank)
                    served = llm.served(rank)
                    assert set(served) == set(want)
                    for name, t in want.items():
                        assert torch.equal(served[name], t), (rank, name)

            await deliver(buf, 1)
            assert await core.commit_weights(1) == 1
            assert_serves(state)
            assert llm.weight_version == "1" and (await core.status()).weight_version == 1

            # a canary's rollback: version 2 served, then every rank swapped back to version 1
            state2 = random_state(CONFIG, seed=4)
            await deliver(push_all(state2, world=2, version=2), 2)
            assert await core.commit_weights(2) == 2
            assert_serves(state2)
            assert await core.rollback_weights(2) == 1
            assert_serves(state)
            status = await core.status()
            assert llm.weight_version == "1" and status.rolled_back_version == 2

            # a load that fails on rank 1 after rank 0 loaded: the replica says it is out of
            # service, the router stops routing to it and has it recreated (its process killed
            # with restart, so Ray brings it back without weights and weight-sync resyncs it)
            llm.fail_update, llm.fail_rank = "load", 1
            await deliver(push_all(random_state(CONFIG, seed=5), world=2, version=3), 3)
            with pytest.raises(vllm_engine.SwapError, match="version 3 failed while loading"):
                await core.commit_weights(3)
            status = await core.status()
            assert not status.ready and "mixed weights" in status.engine["broken"]
            killed = []
            router._on_replica_broken = manager.recreate_replica  # as service.py wires it
            manager.actors["long-r0"] = actor = object()
            monkeypatch.setattr("ray.kill", lambda a, no_restart=True: killed.append((a, no_restart)))
            router.observe_status(dep.replicas[0], status)
            await asyncio.sleep(0)
            assert not dep.replicas[0].routable and killed == [(actor, False)]
        finally:
            await core.shutdown()

    asyncio.run(run())
