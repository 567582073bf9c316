"""Weight-sync picks shared memory from where a receiver really is, never from what it is told:
a receiver that reports another host (or none) gets gRPC even where shared memory would work, and
one that reports weight-sync's host but cannot read its probe segment (its own shm directory) gets
gRPC too. Bytes per transport and host show in GetVersion's routes and in the Prometheus counter."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from bench.harness.synthetic_weights import rank_requests
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.process.hosts import host_identity
from services.kit.rpc.interceptors import ServerInterceptor
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.service import make
from services.weight_sync.transport.arena import ProbeSegment
from services.weights import WeightOnlyEngine, WeightStager, serve_engine

CONFIG = ModelConfig.tiny()
REPO_ROOT = Path(__file__).resolve().parents[3]
OTHER_HOST = "0123456789abcdef"


def delivered_bytes(transport: str, host: str) -> float:
    value = REGISTRY.get_sample_value(
        "looprl_weight_sync_delivered_bytes_total", {"transport": transport, "host": host}
    )
    return value or 0.0


class WeightSync:
    async def start(self) -> WeightSync:
        self.servicer = make(WeightSyncConfig(use_bus=False, bucket_bytes=8192, retry_backoff_s=0.05))
        self.server = grpc.aio.server(interceptors=[ServerInterceptor("weight-sync", lambda: None)])
        weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = weightsync_pb2_grpc.WeightSyncServiceStub(self.channel)
        return self

    async def register(self, name: str, address: str, host_id: str) -> None:
        await self.stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment=name,
                every_k_versions=1,
                ranks=[weightsync_pb2.TargetRank(rank=0, address=address, host_id=host_id)],
                layout=weightsync_pb2.TargetLayout(
                    tensor_parallel=1, naming="hf", dtype=common_pb2.D_TYPE_FLOAT32
                ),
            )
        )

    async def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        config_json = json.dumps(CONFIG.to_hf_dict())
        reqs = rank_requests(
            state, version=version, rank=0, world=1, max_message_bytes=4096, model_config_json=config_json
        )
        await self.stub.PushShards(iter(list(reqs)))

    async def wait_ready(self, version: int, names: list[str], timeout: float = 30.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            resp = await self.stub.GetVersion(weightsync_pb2.GetVersionRequest())
            states = {t.deployment: t for t in resp.targets}
            if all(
                n in states and states[n].version == version and states[n].state == "ready" for n in names
            ):
                return resp, states
            assert asyncio.get_running_loop().time() < deadline, f"not at version {version}: {states}"
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.servicer.deliverer.close()
        await self.channel.close()
        await self.server.stop(None)


def model_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in Qwen2ForCausalLM(CONFIG).named_parameters()}


async def test_a_receiver_reporting_another_host_gets_grpc_not_shared_memory():
    ws = await WeightSync().start()
    engines, servers = {}, []
    try:
        for name in ("here", "liar", "silent"):
            engines[name] = WeightOnlyEngine(WeightStager(rank_params(CONFIG, Layout(1, "hf"), 0), rank=0))
            server, address = await serve_engine(engines[name])
            servers.append(server)
            # All three run in this process, so shared memory would reach each of them.
            await ws.register(
                name, address, {"here": host_identity(), "liar": OTHER_HOST, "silent": ""}[name]
            )
        shm_before = delivered_bytes("shm", host_identity())
        grpc_before = delivered_bytes("grpc", OTHER_HOST) + delivered_bytes("grpc", "unknown")
        state = model_state(0)
        await ws.push(state, 0)
        resp, states = await ws.wait_ready(0, list(engines))

        assert resp.host_id == host_identity()
        routes = {name: states[name].routes[0] for name in engines}
        for name, route in routes.items():
            print(
                f"{name}: {route.transport} to host {route.host_id or '?'}: {route.bytes_delivered} bytes "
                f"({route.reason})"
            )
        assert routes["here"].transport == "shm" and routes["here"].reason == "same host, probe read back"
        assert routes["liar"].transport == "grpc" and "other host" in routes["liar"].reason
        assert routes["silent"].transport == "grpc" and "no host identity" in routes["silent"].reason
        for name, engine in engines.items():
            assert torch.equal(
                engine.weights["model.embed_tokens.weight"], state["model.embed_tokens.weight"]
            )
            assert routes[name].bytes_delivered == states[name].last_bytes > 0
        # What the receivers saw: only "here" read anything from shared memory.
        assert engines["here"].receiver.shm_bytes_received == engines["here"].receiver.bytes_received > 0
        assert engines["liar"].receiver.shm_bytes_received == 0 < engines["liar"].receiver.bytes_received
        assert engines["silent"].receiver.shm_bytes_received == 0
        assert delivered_bytes("shm", host_identity()) - shm_before == routes["here"].bytes_delivered
        grpc_after = delivered_bytes("grpc", OTHER_HOST) + delivered_bytes("grpc", "unknown")
        assert grpc_after - grpc_before == routes["liar"].bytes_delivered + routes["silent"].bytes_delivered
    finally:
        await ws.stop()
        for server in servers:
            await server.stop(None)


async def test_a_receiver_claiming_this_host_without_its_shared_memory_fails_the_probe(tmp_path):
    """The receiver runs in another process with its own shm directory, and the registration says
    it is on weight-sync's host: the probe finds no segment there, so it gets gRPC."""
    own_shm = tmp_path / "shm"
    own_shm.mkdir()
    address_file = tmp_path / "address"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.harness.engine_process", "--address-file", str(address_file)],
        cwd=REPO_ROOT,
        env={**os.environ, "LOOPRL_SHM_DIR": str(own_shm)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    ws = await WeightSync().start()
    try:
        for _ in range(600):
            if address_file.exists() and address_file.read_text().endswith("\n"):
                break
            assert proc.poll() is None, proc.stdout.read()
            await asyncio.sleep(0.1)
        address, engine_host = address_file.read_text().split()
        assert engine_host != host_identity()  # it does see another shared-memory directory
        await ws.register("elsewhere", address, host_identity())
        await ws.push(model_state(1), 0)
        _, states = await ws.wait_ready(0, ["elsewhere"])
        route = states["elsewhere"].routes[0]
        assert route.transport == "grpc", route
        assert route.reason.startswith("probe failed: NOT_FOUND"), route.reason
        assert route.bytes_delivered == states["elsewhere"].last_bytes > 0
        async with grpc.aio.insecure_channel(address) as channel:
            status = await inference_pb2_grpc.InferenceEngineServiceStub(channel).Status(
                inference_pb2.StatusRequest(), timeout=10
            )
        assert status.weight_version == 0 and status.host_id == engine_host
    finally:
        await ws.stop()
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    weights = [line.split() for line in out.splitlines() if line.startswith("WEIGHTS")]
    assert weights and int(weights[0][2]) > 0 and int(weights[0][3]) == 0, out


async def test_probe_rpc_reads_back_the_nonce_and_rejects_bad_input():
    engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, Layout(1, "hf"), 0), rank=0))
    server, address = await serve_engine(engine)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceEngineServiceStub(channel)
            with ProbeSegment() as probe:
                reply = await stub.ProbeSharedMemory(probe.request(), timeout=10)
                assert reply.data == probe.nonce and reply.host_id == host_identity()
                gone = probe.request()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ProbeSharedMemory(gone, timeout=10)  # unlinked on close
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "segment" in err.value.details()
            for bad, field in (
                (inference_pb2.ProbeSharedMemoryRequest(segment="../etc/passwd", nbytes=8), "segment"),
                (inference_pb2.ProbeSharedMemoryRequest(segment=gone.segment, nbytes=0), "nbytes"),
                (inference_pb2.ProbeSharedMemoryRequest(segment=gone.segment, nbytes=1 << 20), "nbytes"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ProbeSharedMemory(bad, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(f"{field}:"), err.value.details()
    finally:
        await server.stop(None)
