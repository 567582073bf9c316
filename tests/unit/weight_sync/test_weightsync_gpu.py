"""CUDA IPC delivery into a GPU-staging receiver (runs only where CUDA is available)."""

from __future__ import annotations

import pytest
import torch

from bench.harness.synthetic_weights import random_state, rank_requests
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params, shard_state_dict
from services.weight_sync.plan import build_deployment_plan
from services.weight_sync.planned_bucket import PlannedBucket
from services.weight_sync.transport import Delivery, Endpoint
from services.weight_sync.transport.gpu import CudaIpcTransport
from services.weight_sync.versions import VersionStore
from services.weights import WeightOnlyEngine, WeightStager, serve_engine


@pytest.mark.gpu
async def test_cuda_ipc_delivery_matches_reference():
    config, layout = ModelConfig.tiny(), Layout(2, "fused")
    state = random_state(config)
    store = VersionStore(shm=False)
    for rank in range(2):
        for req in rank_requests(state, version=0, rank=rank, world=2, max_message_bytes=4096):
            buf = store.buffer_for(req)
            for i, c in enumerate(req.shards):
                buf.add_chunk(rank, c, i)
    buf.ranks_done.update({0, 1})
    plan = build_deployment_plan(buf.layout(), config, layout, 8192)
    transport = CudaIpcTransport("cuda")
    servers = []
    try:
        for rp in plan.ranks:
            engine = WeightOnlyEngine(
                WeightStager(rank_params(config, layout, rp.rank), rank=rp.rank, device="cuda")
            )
            server, address = await serve_engine(engine)
            servers.append(server)
            ep = Endpoint(address, rp.rank, "gpu")
            buckets = [PlannedBucket(s, rp.dtype, buf.chunks) for s in rp.buckets]
            (res,) = (await transport.stage(Delivery(0, buckets), [ep])).values()
            assert res.error is None and res.complete
            await transport.commit(ep, 0)
            want = shard_state_dict(state, config, layout, rp.rank)
            assert all(torch.equal(engine.weights[n].cpu(), want[n]) for n in want)
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
