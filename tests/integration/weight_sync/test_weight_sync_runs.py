"""Two runs on one real weight-sync process (NATS KV for its state): each run's trainer pushes its
own versions, numbered from 0 in each run, and each run's deployment only ever receives its own
run's weights; GetVersion answers per run; a weight-sync restart restores both runs' targets and
versions; UnregisterTarget abandons an in-flight delivery to the deployment without holding back
the other run, and nothing more is delivered to it."""

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
from services.kit.config.recipe import run_deployment_name
from services.kit.local.infra import free_port
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weights import WeightOnlyEngine, WeightStager, serve_engine
from tests.support.weight_sync_process import start_weight_sync, stop_weight_sync, wait_for, wait_ready

CONFIG = ModelConfig.tiny()
PROBE = "model.norm.weight"  # a parameter every seed fills differently: says whose weights arrived


async def push(stub, state, run_id: str, version: int):
    config_json = json.dumps(CONFIG.to_hf_dict())
    reqs = rank_requests(
        state, version=version, rank=0, world=1, run_id=run_id, model_config_json=config_json
    )
    return await stub.PushShards(iter(list(reqs)))


async def status(stub, run_id: str) -> tuple[int, list[tuple[str, str, int]]]:
    resp = await stub.GetVersion(weightsync_pb2.GetVersionRequest(run_id=run_id))
    return resp.latest_version, [(t.deployment, t.run_id, t.version) for t in resp.targets]


@pytest.mark.slow
async def test_two_runs_get_only_their_own_versions_across_a_restart_and_an_unregister(nats_url):
    tag = uuid.uuid4().hex[:8]
    run_a, run_b = f"runs-a-{tag}", f"runs-b-{tag}"
    deployment = {run_a: run_deployment_name(run_a, "actor"), run_b: run_deployment_name(run_b, "actor")}
    port = free_port()
    env = dict(
        os.environ,
        LOOPRL_WEIGHTSYNC_GRPC_PORT=str(port),
        LOOPRL_WEIGHTSYNC_NATS_URL=nats_url,
        LOOPRL_WEIGHTSYNC_RUN_ID=f"runs-default-{tag}",
        LOOPRL_WEIGHTSYNC_BUCKET_BYTES="4096",
        LOOPRL_WEIGHTSYNC_LOG_LEVEL="WARNING",
        LOOPRL_WEIGHTSYNC_GRACE_SECONDS="2",
    )
    # Each run's version v is its own random state: whose weights an engine holds is unambiguous.
    states = {
        (run, v): random_state(CONFIG, seed=100 * i + v)
        for i, run in enumerate((run_a, run_b))
        for v in range(5)
    }
    engines: dict[str, WeightOnlyEngine] = {}
    installed: dict[str, list[tuple[int, torch.Tensor]]] = {run_a: [], run_b: []}  # every commit's weights
    servers = []
    slow = {"on": False}
    for run in (run_a, run_b):
        engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, Layout(1, "hf"), 0), rank=0))
        swap = engine.receiver.on_commit

        def record(version, state, run=run, swap=swap):
            installed[run].append((version, state[PROBE].clone()))
            swap(version, state)

        engine.receiver.on_commit = record
        server, address = await serve_engine(engine)
        engines[run], engine.address = engine, address
        servers.append(server)
    stage_b = engines[run_b].receiver._stage

    def slow_stage_b(request, reader):  # a slow link to run B's deployment: "in flight" is a wide window
        if slow["on"]:
            time.sleep(0.03)
        return stage_b(request, reader)

    engines[run_b].receiver._stage = slow_stage_b

    def holds(run: str, version: int) -> bool:
        engine = engines[run]
        return engine.version == version and torch.equal(engine.weights[PROBE], states[(run, version)][PROBE])

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
    proc = start_weight_sync(env)
    try:
        await wait_ready(stub, proc)
        for run in (run_a, run_b):
            await stub.RegisterTarget(
                weightsync_pb2.RegisterTargetRequest(
                    deployment=deployment[run],
                    run_id=run,
                    layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf"),
                    ranks=[weightsync_pb2.TargetRank(rank=0, address=engines[run].address)],
                )
            )
        # Both runs push a version 0 and a version 1: two versions each, four in all. (A version
        # pushed while its deployment still takes the previous one may be skipped for a newer one.)
        for version in (0, 1):
            for run in (run_a, run_b):
                await push(stub, states[(run, version)], run, version)
        await push(stub, states[(run_a, 2)], run_a, 2)
        await wait_for(lambda: holds(run_a, 2) and holds(run_b, 1))
        assert await status(stub, run_a) == (2, [(deployment[run_a], run_a, 2)])
        assert await status(stub, run_b) == (1, [(deployment[run_b], run_b, 1)])

        stop_weight_sync(proc)
        proc = start_weight_sync(env)
        await wait_ready(stub, proc)
        # The restart restored both runs: their latest numbers and their targets' versions.
        assert await status(stub, run_a) == (2, [(deployment[run_a], run_a, 2)])
        assert await status(stub, run_b) == (1, [(deployment[run_b], run_b, 1)])
        await push(stub, states[(run_b, 2)], run_b, 2)
        await push(stub, states[(run_a, 3)], run_a, 3)
        await wait_for(lambda: holds(run_a, 3) and holds(run_b, 2))

        # Run B's deployment goes away while its version 3 is on the way: that delivery is
        # abandoned, run A's version 4 is delivered all the same, and B's next version goes nowhere.
        slow["on"] = True
        await push(stub, states[(run_b, 3)], run_b, 3)
        await wait_for(
            lambda: engines[run_b].stager.staged_version == 3 and engines[run_b].stager.bytes_staged > 0
        )
        await stub.UnregisterTarget(weightsync_pb2.UnregisterTargetRequest(deployment=deployment[run_b]))
        await push(stub, states[(run_a, 4)], run_a, 4)
        await push(stub, states[(run_b, 4)], run_b, 4)
        slow["on"] = False  # what the receiver had buffered of v3 drains: staged, never committed
        await wait_for(lambda: holds(run_a, 4))
        await asyncio.sleep(1.0)  # time enough for a commit of v3, or a wrongly scheduled B version 4
        assert await status(stub, run_b) == (4, [])
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.UnregisterTarget(weightsync_pb2.UnregisterTargetRequest(deployment=deployment[run_b]))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and deployment[run_b] in gone.value.details()

        # Every version each deployment committed was its own run's weights, newer each time; B
        # kept serving its version 2 (neither its abandoned 3 nor its 4 came).
        for run in (run_a, run_b):
            versions = [v for v, _ in installed[run]]
            assert versions == sorted(set(versions)), versions
            for version, weights in installed[run]:
                assert torch.equal(weights, states[(run, version)][PROBE]), (run, version)
        assert installed[run_a][-1][0] == 4 and installed[run_b][-1][0] == 2 and holds(run_b, 2)
        stop_weight_sync(proc)
        proc = start_weight_sync(env)
        await wait_ready(stub, proc)
        assert await status(stub, run_b) == (4, [])  # the unregistered target stays gone
        assert await status(stub, run_a) == (4, [(deployment[run_a], run_a, 4)])
        await stub.UnregisterTarget(weightsync_pb2.UnregisterTargetRequest(deployment=deployment[run_a]))
        assert await status(stub, run_a) == (4, [])
    finally:
        await channel.close()
        stop_weight_sync(proc)
        for server in servers:
            await server.stop(None)
