"""Killing weight-sync (SIGKILL) in the middle of a transfer: the deployment keeps serving the old
version and drops the half-staged one; a restarted weight-sync restores its targets and latest
version from NATS KV, takes the lost version when it is pushed again, and the next version is
delivered completely."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import grpc
import pytest
import torch

from bench.harness.synthetic_weights import random_state, rank_requests
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.local.infra import free_port
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weights import WeightOnlyEngine, WeightStager, serve_engine
from tests.support.weight_sync_process import start_weight_sync, stop_weight_sync, wait_for, wait_ready

CONFIG = ModelConfig.tiny()


async def push(stub, state, version):
    config_json = json.dumps(CONFIG.to_hf_dict())
    reqs = list(rank_requests(state, version=version, rank=0, world=1, model_config_json=config_json))
    return await stub.PushShards(iter(reqs))


@pytest.mark.slow
async def test_kill_mid_transfer_keeps_old_version_and_restart_syncs_next(nats_url):
    port = free_port()
    run = f"kill-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        LOOPRL_WEIGHTSYNC_GRPC_PORT=str(port),
        LOOPRL_WEIGHTSYNC_NATS_URL=nats_url,
        LOOPRL_WEIGHTSYNC_RUN_ID=run,
        LOOPRL_WEIGHTSYNC_BUCKET_BYTES="4096",
        LOOPRL_WEIGHTSYNC_LOG_LEVEL="WARNING",
        LOOPRL_WEIGHTSYNC_GRACE_SECONDS="2",
    )
    layout = Layout(1, "hf")
    engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, layout, 0), rank=0))
    stage = engine.receiver._stage
    slow = {"on": False}

    def slow_stage(request, reader):  # a slow link: makes "mid-transfer" a wide window
        if slow["on"]:
            time.sleep(0.03)
        return stage(request, reader)

    engine.receiver._stage = slow_stage
    server, address = await serve_engine(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
    proc = start_weight_sync(env)
    try:
        await wait_ready(stub, proc, run)
        await stub.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment="kill-d",
                run_id=run,
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf"),
                ranks=[weightsync_pb2.TargetRank(rank=0, address=address)],
            )
        )
        v0, v1, v2 = (random_state(CONFIG, seed=s) for s in (0, 1, 2))
        await push(stub, v0, 0)
        await wait_for(lambda: engine.version == 0)

        slow["on"] = True
        await push(stub, v1, 1)
        await wait_for(lambda: engine.stager.staged_version == 1 and engine.stager.bytes_staged > 0)
        proc.kill()
        proc.wait(10)
        # Whatever the kill interrupted -- an open stream (the receiver aborts v1), the gap between
        # two StageWeights calls (v1 stays partly staged), or nothing (HTTP/2 had buffered every
        # bucket: v1 staged complete) -- v1 is never committed and v0 keeps serving; v2 replaces
        # any leftover staging below.
        await asyncio.sleep(2.0)
        assert engine.version == 0 and engine.commits == [0]
        assert torch.equal(engine.weights["model.norm.weight"], v0["model.norm.weight"])

        slow["on"] = False
        proc = start_weight_sync(env)
        status = await wait_ready(stub, proc, run)
        assert status.latest_version == 1 and not status.latest_bytes_held  # the number from KV only
        assert [(t.deployment, t.version) for t in status.targets] == [("kill-d", 0)]
        # The restart kept v1's number but not its bytes, and says so: the trainer pushes v1 again
        # (it asks while a step waits for its batch, trainer/loop.py) and the deployment gets it...
        await push(stub, v1, 1)
        await wait_for(lambda: engine.version == 1)
        assert torch.equal(engine.weights["model.norm.weight"], v1["model.norm.weight"])
        assert (await wait_ready(stub, proc, run)).latest_bytes_held
        # ...while a version weight-sync holds is not taken twice.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(stub, v1, 1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await push(stub, v2, 2)
        await wait_for(lambda: engine.version == 2)
        assert torch.equal(engine.weights["model.norm.weight"], v2["model.norm.weight"])
        assert engine.stager.staged_version is None
    finally:
        await channel.close()
        stop_weight_sync(proc)
        await server.stop(None)
