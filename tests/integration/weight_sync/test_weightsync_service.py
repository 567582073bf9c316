"""Weight-sync service end to end, in process: a 2-rank FSDP "trainer" pushes real model weights,
deployments with different layouts (tp=1 HF names over gRPC, tp=2 fused over shared memory) receive
them, and their log-probs match the trainer's model; bytes received equal the model size; bad pushes
are rejected with a clear status and nothing is swapped."""

from __future__ import annotations

import asyncio
import json
import zlib

import grpc
import pytest
import torch

from bench.harness.synthetic_weights import rank_requests
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.process.hosts import host_identity
from services.kit.rpc.interceptors import ServerInterceptor
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tp_local import LocalTPGroup
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.service import make
from services.weights import WeightOnlyEngine, WeightStager, serve_engine

CONFIG = ModelConfig.tiny()
F32 = common_pb2.DType.D_TYPE_FLOAT32
INFERENCE = "looprl.inference.v1.InferenceEngineService"


class Harness:
    async def start(self, **cfg):
        self.servicer = make(WeightSyncConfig(use_bus=False, bucket_bytes=8192, retry_backoff_s=0.05, **cfg))
        self.server = grpc.aio.server(interceptors=[ServerInterceptor("weight-sync", lambda: None)])
        weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = weightsync_pb2_grpc.WeightSyncServiceStub(self.channel)
        self.engines: dict[str, list[WeightOnlyEngine]] = {}
        self.engine_servers = []
        return self

    async def add_deployment(self, name, layout, same_host):
        """same_host: the deployment reports this host's identity (shared memory), else none (gRPC)."""
        engines, ranks = [], []
        for r in range(layout.tp_size):
            engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, layout, r), rank=r))
            server, address = await serve_engine(engine)
            self.engine_servers.append(server)
            engines.append(engine)
            host_id = host_identity() if same_host else ""
            ranks.append(weightsync_pb2.TargetRank(rank=r, address=address, host_id=host_id))
        self.engines[name] = engines
        dtype = common_pb2.DType.D_TYPE_BFLOAT16 if layout.dtype == "bfloat16" else F32
        await self.stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment=name,
                ranks=ranks,
                every_k_versions=1,
                layout=weightsync_pb2.TargetLayout(
                    tensor_parallel=layout.tp_size, naming=layout.naming, dtype=dtype
                ),
            )
        )
        return engines

    async def push(self, state, version, world=2):
        config_json = json.dumps(CONFIG.to_hf_dict())

        async def rank(r):
            reqs = rank_requests(
                state,
                version=version,
                rank=r,
                world=world,
                max_message_bytes=4096,
                model_config_json=config_json,
            )
            return await self.stub.PushShards(iter(list(reqs)))

        return await asyncio.gather(*(rank(r) for r in range(world)))

    async def wait_version(self, version, names, timeout=20.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            resp = await self.stub.GetVersion(weightsync_pb2.GetVersionRequest())
            states = {t.deployment: t for t in resp.targets}
            if all(states[n].version == version and states[n].state == "ready" for n in names):
                return states
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"deployments did not reach version {version}: {states}")
            await asyncio.sleep(0.05)

    async def stop(self):
        await self.servicer.deliverer.close()
        await self.channel.close()
        await self.server.stop(None)
        for s in self.engine_servers:
            await s.stop(None)


def trainer_model(seed):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(CONFIG).eval()
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_logprobs(model, prompt):
    ids = torch.tensor(prompt)
    with torch.no_grad():
        logits = model(ids, torch.arange(len(prompt)), torch.tensor([0, len(prompt)]))
    return token_logprobs(logits, ids, torch.tensor([0, len(prompt)]))[1:]


def deployment_logprobs(engines, layout, prompt):
    group = LocalTPGroup(CONFIG, layout, max_slots=1, max_len=64)
    try:
        group.load_shards([e.weights for e in engines])
        slot = group.allocate()
        logits = group.prefill(slot, torch.tensor(prompt), all_logits=True)
    finally:
        group.close()
    return torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


async def test_trainer_to_tp1_and_tp2_deployments_logprobs_match():
    h = await Harness().start()
    try:
        tp1 = await h.add_deployment("tp1-hf", Layout(1, "hf"), same_host=False)
        tp2 = await h.add_deployment("tp2-fused", Layout(2, "fused"), same_host=True)
        prompt = [3, 17, 42, 8, 99, 5, 23, 61]
        for version, seed in ((0, 0), (1, 1)):
            model, state = trainer_model(seed)
            responses = await h.push(state, version)
            assert any(r.version_complete for r in responses)
            states = await h.wait_version(version, ["tp1-hf", "tp2-fused"])
            want = trainer_logprobs(model, prompt)
            for engines, layout in ((tp1, Layout(1, "hf")), (tp2, Layout(2, "fused"))):
                got = deployment_logprobs(engines, layout, prompt)
                assert torch.allclose(got, want, atol=1e-4), (layout, (got - want).abs().max())
            # Byte accounting: tp=1 receives the model once; tp=2 the model once plus the norms
            # (embeddings are vocab-parallel).
            model_bytes = sum(t.numel() * 4 for t in state.values())
            assert states["tp1-hf"].last_bytes == model_bytes
            tp2_bytes = sum(p.nbytes for r in range(2) for p in rank_params(CONFIG, Layout(2, "fused"), r))
            assert states["tp2-fused"].last_bytes == tp2_bytes
            assert sum(e.receiver.bytes_received for e in tp2) == tp2_bytes * (version + 1)
            replicated = sum(t.numel() * 4 for n, t in state.items() if "norm" in n)
            assert tp2_bytes == model_bytes + replicated
        assert h.servicer.deliverer.plans.computed == 2  # one plan per layout, reused for version 1
    finally:
        await h.stop()


async def _push_expect(h, reqs, code, text):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.stub.PushShards(iter(reqs))
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()


async def test_bad_pushes_are_rejected_and_nothing_is_swapped():
    h = await Harness().start()
    try:
        engines = await h.add_deployment("d", Layout(1, "hf"), same_host=False)
        _, state = trainer_model(0)
        await h.push(state, 0)
        await h.wait_version(0, ["d"])
        before = {n: t.clone() for n, t in engines[0].weights.items()}

        def one(chunk_edit=None, version=1, **req_edit):
            req = next(rank_requests(state, version=version, rank=0, world=1, max_message_bytes=1 << 30))
            req.last = True
            if chunk_edit:
                chunk_edit(req.shards[0])
            for k, v in req_edit.items():
                setattr(req, k, v)
            return [req]

        def wrong_shape(c):
            c.global_shape[1] += 1

        def wrong_dtype(c):
            c.dtype = common_pb2.DType.D_TYPE_BFLOAT16

        def wrong_offset(c):
            c.row_offset = c.global_shape[0]

        def corrupt(c):
            c.data = bytes([c.data[0] ^ 1]) + c.data[1:]

        def unknown(c):
            c.name = "model.layers.0.self_attn.nope.weight"

        code = grpc.StatusCode
        await _push_expect(h, one(wrong_shape), code.INVALID_ARGUMENT, "shards[0].global_shape")
        await _push_expect(h, one(wrong_dtype), code.INVALID_ARGUMENT, "shards[0].data")
        await _push_expect(h, one(wrong_offset), code.INVALID_ARGUMENT, "shards[0].row_offset")
        await _push_expect(h, one(corrupt), code.DATA_LOSS, "shards[0].hash64")

        def crc32_only(c):  # no hash64: nothing weight-sync verifies vouches for the bytes
            c.ClearField("hash64")
            c.crc32 = zlib.crc32(c.data)

        await _push_expect(h, one(crc32_only), code.INVALID_ARGUMENT, "shards[0].hash64")
        await _push_expect(h, one(unknown), code.INVALID_ARGUMENT, "unknown parameter name")
        await _push_expect(
            h, one(version=0), code.FAILED_PRECONDITION, "not newer than the latest complete version 0"
        )
        await _push_expect(h, one(trainer_rank=3), code.INVALID_ARGUMENT, "trainer_rank")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.RegisterTarget(
                weightsync_pb2.RegisterTargetRequest(
                    deployment="x",
                    layout=weightsync_pb2.TargetLayout(tensor_parallel=2, naming="fused"),
                    ranks=[weightsync_pb2.TargetRank(rank=0, address="127.0.0.1:1")],
                )
            )
        assert info.value.code() == code.INVALID_ARGUMENT and "ranks" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.RequestSync(weightsync_pb2.RequestSyncRequest(deployment="nope"))
        assert info.value.code() == code.NOT_FOUND
        # The service still works and the deployment never saw any of it.
        resp = await h.stub.GetVersion(weightsync_pb2.GetVersionRequest())
        assert resp.latest_version == 0 and resp.targets[0].version == 0
        assert engines[0].commits == [0]
        assert all(torch.equal(engines[0].weights[n], before[n]) for n in before)
        _, state1 = trainer_model(1)
        await h.push(state1, 1)
        await h.wait_version(1, ["d"])
    finally:
        await h.stop()


async def test_restarted_replica_requests_the_latest_version_and_every_k_policy():
    h = await Harness().start()
    try:
        every = await h.add_deployment("every", Layout(1, "hf"), same_host=True)
        _, s0 = trainer_model(0)
        await h.push(s0, 0)
        await h.wait_version(0, ["every"])
        # A replica restarts with nothing loaded: it asks for the latest version.
        fresh = WeightOnlyEngine(WeightStager(rank_params(CONFIG, Layout(1, "hf"), 0), rank=0))
        every[0].receiver.stager = fresh.stager
        every[0].weights = {}
        resp = await h.stub.RequestSync(weightsync_pb2.RequestSyncRequest(deployment="every"))
        assert resp.version == 0
        for _ in range(200):
            if every[0].stager.serving_version == 0:
                break
            await asyncio.sleep(0.05)
        assert torch.equal(every[0].weights["model.norm.weight"], s0["model.norm.weight"])
    finally:
        await h.stop()


async def test_a_silent_host_does_not_hold_back_the_other_hosts():
    """A replica on a host that went silent (its link down: connections never answered, nothing
    refused) must not delay the commit on another host: each host is a delivery of its own."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the TCP handshake; nothing ever answers
    h = await Harness().start(stage_timeout_s=30.0)
    try:
        await h.add_deployment("live", Layout(1, "hf"), same_host=False)
        await h.stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment="lost",
                ranks=[
                    weightsync_pb2.TargetRank(
                        rank=0, address=f"127.0.0.1:{silent.getsockname()[1]}", host_id="a-lost-host"
                    )
                ],
                every_k_versions=1,
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf", dtype=F32),
            )
        )
        _, s0 = trainer_model(0)
        await h.push(s0, 0)
        started = asyncio.get_running_loop().time()
        states = await h.wait_version(0, ["live"], timeout=10.0)
        print(f"live served version 0 after {asyncio.get_running_loop().time() - started:.2f}s")
        assert states["lost"].state == "syncing" and states["lost"].version == -1, states["lost"]
        # The host comes back refusing: its delivery fails at once and stops retrying.
        silent.close()
        for _ in range(200):
            if not h.servicer.deliverer._tasks:
                break
            await asyncio.sleep(0.05)
    finally:
        silent.close()
        await h.stop()


async def test_a_lone_replica_commits_each_version_as_its_last_bucket_lands_without_a_commit_call():
    from prometheus_client import REGISTRY

    from services.inference_router.replica import ReplicaCore
    from services.kit.config.recipe import DeploymentSpec

    def answered(method: str) -> float:
        labels = {"service": "replica/lone-r0", "method": f"/{INFERENCE}/{method}", "code": "OK"}
        return REGISTRY.get_sample_value("looprl_rpc_requests_total", labels) or 0.0

    h = await Harness().start()
    core = ReplicaCore(DeploymentSpec(name="lone", max_model_len=64), replica="lone-r0")
    try:
        address = await core.start()
        await h.stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment="lone",
                ranks=[weightsync_pb2.TargetRank(rank=0, address=address, host_id=host_identity())],
                every_k_versions=1,
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf", dtype=F32),
            )
        )
        prompt = [3, 17, 42, 8, 99, 5, 23, 61]
        commits = answered("CommitWeights")
        for version in (0, 1):
            _, state = trainer_model(version)
            await h.push(state, version)
            await h.wait_version(version, ["lone"])
            assert (await core.status()).weight_version == version
            served = await core.generate_proto(
                inference_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=1, temperature=1.0)
                )
            )
            assert served.completions[0].weight_version == version
        assert answered("StageWeights") > 0 and answered("CommitWeights") == commits
    finally:
        await h.stop()
        await core.shutdown()
