"""Canary deployments end to end, in process: weight-sync delivers to a deployment of two real CPU
engine replicas (continuous-batching engine + WeightReceiver, as a replica wires them). A version
that moves the golden prompts' log-probs a little (a training step) reaches both replicas; a version
whose bytes are intact but whose weights are wrong (scaled by 100) is served by the canary replica
only, detected by log-prob drift, rolled back there, never committed on the other replica, and the
next good version goes through."""

from __future__ import annotations

import asyncio

import grpc
import torch
from prometheus_client import REGISTRY

from bench.harness.synthetic_weights import push_version, random_state
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.inference_router.engine.cpu import CPUEngine
from services.inference_router.replica import engine_request
from services.kit.rpc.interceptors import ServerInterceptor
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weight_sync import canary
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.service import make
from services.weights import WeightReceiver, WeightServicer, WeightStager, add_engine_servicer

CONFIG = ModelConfig.tiny()
LAYOUT = Layout(1, "hf")
PROMPTS = [[5, 9, 14, 3, 22], [40, 2, 7], [11, 11, 30, 8, 1, 19]]


class CpuReplica(WeightServicer):
    """A tp=1 replica: the continuous-batching CPU engine serves, a WeightReceiver stages, commits
    and rolls back (retired tensors go back to the stager as the rollback point)."""

    def __init__(self) -> None:
        self.engine = CPUEngine.create(CONFIG, None, layout=LAYOUT, max_batch_size=8, max_model_len=64)
        self.stager = WeightStager(rank_params(CONFIG, LAYOUT, 0), rank=0)
        self.serving: dict[str, torch.Tensor] = {}
        self.receiver = WeightReceiver(self.stager, self._swap)

    async def _swap(self, version, state):
        serving = self.engine.status().weight_version
        if version >= serving:
            await self.engine.load_weights(version, state)
        else:
            # A rollback. The engine only moves forward (load_weights refuses older versions), so swap the
            # held weights in between two steps under the current number, then report the old number.
            # ReplicaCore needs the same (an engine-level rollback); see the weight-sync report.
            await self.engine.swap(serving, lambda: self.engine.executor.load_weights(state))
            self.engine.version = version
        old, self.serving = self.serving, dict(state)
        self.stager.give_back(old)

    async def Generate(self, request, context):
        [result] = await self.engine.generate([engine_request(request)])
        return inference_pb2.GenerateResponse(
            completions=[
                inference_pb2.Completion(
                    token_ids=c.token_ids, logprobs=c.logprobs, weight_version=c.weight_version
                )
                for c in result.completions
            ]
        )

    async def Status(self, request, context):
        return inference_pb2.StatusResponse(weight_version=self.engine.status().weight_version)


async def serve(servicer):
    server = grpc.aio.server(interceptors=[ServerInterceptor("replica", lambda: None)])
    add_engine_servicer(server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def push(stub, state, version):
    await push_version(stub, state, CONFIG, version)


async def settle(stub, predicate, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        (target,) = (await stub.GetVersion(weightsync_pb2.GetVersionRequest())).targets
        if predicate(target):
            return target
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"target did not settle: {target}")
        await asyncio.sleep(0.05)


def nudged(state, seed, scale=1e-3):
    """What a training step does to weights: a small change everywhere."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in state.items()}


async def answers(replica):
    stub = inference_pb2_grpc.InferenceEngineServiceStub(replica.channel)
    return await canary.golden_answers(stub, PROMPTS, 6)


def metric(name: str, **labels: str) -> float:
    """The sum of a metric's samples in this process's registry that carry `labels`."""
    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_canary_passes_a_training_step_and_rolls_back_scaled_weights():
    rejected_before = metric("looprl_weight_sync_rejected_versions_total", deployment="canary-rollback")
    synced_before = metric("looprl_weight_sync_sync_seconds_count", deployment="canary-rollback")
    servicer = make(WeightSyncConfig(use_bus=False, bucket_bytes=1 << 16, retry_backoff_s=0.05))
    ws_server = grpc.aio.server(interceptors=[ServerInterceptor("weight-sync", lambda: None)])
    weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, ws_server)
    port = ws_server.add_insecure_port("127.0.0.1:0")
    await ws_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
    replicas, servers = [CpuReplica(), CpuReplica()], []
    try:
        ranks = []
        for name, (shm, replica) in zip(("a", "b"), ((True, replicas[0]), (False, replicas[1])), strict=True):
            server, address = await serve(replica)
            servers.append(server)
            replica.channel = grpc.aio.insecure_channel(address)
            ranks.append(weightsync_pb2.TargetRank(rank=0, address=address, same_host=shm, replica=name))
        await stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment="canary-rollback",
                ranks=ranks,
                canary=True,
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1),
                canary_policy=weightsync_pb2.CanaryPolicy(
                    prompts=[weightsync_pb2.GoldenPrompt(token_ids=p) for p in PROMPTS],
                    tokens_per_prompt=6,
                    max_logprob_drift=0.5,
                ),
            )
        )

        v0 = random_state(CONFIG, seed=3)
        await push(stub, v0, 0)  # no previous version: nothing to compare, both replicas switch
        await settle(stub, lambda t: t.version == 0 and t.state == "ready")

        v1 = nudged(v0, seed=1)
        await push(stub, v1, 1)
        target = await settle(stub, lambda t: t.version == 1 and t.state == "ready")
        assert 0 < target.canary_drift < 0.5 and target.canary_rejected_version == -1
        good = await answers(replicas[1])
        assert [r.engine.status().weight_version for r in replicas] == [1, 1]

        bad = {n: t * 100 for n, t in v1.items()}  # every checksum is valid, the model is garbage
        await push(stub, bad, 2)
        target = await settle(stub, lambda t: t.canary_rejected_version == 2 and t.state == "failed")
        assert target.version == 1 and "canary rejected version 2" in target.last_error
        assert target.canary_drift == -1 or target.canary_drift > 0.5
        assert [r.engine.status().weight_version for r in replicas] == [
            1,
            1,
        ]  # a rolled back, b never switched
        assert replicas[1].stager.staged_version is None  # b dropped what it staged
        assert await answers(replicas[0]) == good  # the canary answers exactly as v1 again

        v3 = nudged(v1, seed=3)
        await push(stub, v3, 3)
        target = await settle(stub, lambda t: t.version == 3 and t.state == "ready")
        assert [r.engine.status().weight_version for r in replicas] == [3, 3]
        assert await answers(replicas[0]) == await answers(replicas[1])
        # The metrics say the same: one rejected version, v3 served, three deliveries timed.
        # counters are per process and other tests in it may use the same deployment names: this test's increments
        assert (
            metric("looprl_weight_sync_rejected_versions_total", deployment="canary-rollback")
            == rejected_before + 1
        )
        assert metric("looprl_weight_sync_deployment_version", deployment="canary-rollback") == 3
        assert (
            metric("looprl_weight_sync_sync_seconds_count", deployment="canary-rollback") == synced_before + 3
        )
    finally:
        await servicer.deliverer.close()
        await channel.close()
        await ws_server.stop(None)
        for r in replicas:
            await r.engine.close()
            if hasattr(r, "channel"):
                await r.channel.close()
        for s in servers:
            await s.stop(None)


def test_drift_compares_up_to_the_first_different_token():
    before = [([1, 2, 3], [-1.0, -2.0, -3.0])]
    assert canary.logprob_drift(before, [([1, 2, 3], [-1.0, -2.0, -3.0])]) == (0.0, 3)
    # Tokens part at position 1: positions 0 and 1 are compared, 2 is not (different context).
    assert canary.logprob_drift(before, [([1, 5, 3], [-1.5, -2.5, -9.0])]) == (0.5, 2)
    assert canary.logprob_drift(before, [([1, 2, 3], [-1.0, float("nan"), -3.0])])[0] == float("inf")
    assert canary.logprob_drift(before, [([], [])])[0] == float("inf")
    assert canary.default_prompts(100) == canary.default_prompts(100)  # fixed across processes
