"""Transports against real gRPC receivers (WeightOnlyEngine on 127.0.0.1): planned buckets arrive
intact over gRPC and shared memory, fan out to several receivers, and a byte corrupted in transit is
caught by the checksum while the receiver keeps serving its old version."""

from __future__ import annotations

import os

import pytest
import torch

from services.kit.weight_transfer import (
    Endpoint,
    GrpcTransport,
    ShmTransport,
    WeightOnlyEngine,
    WeightStager,
    serve_engine,
)
from services.kit.weight_transfer.shm import PREFIX, shm_dir
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params, shard_state_dict
from services.weight_sync.plan import PlannedBucket, build_deployment_plan
from services.weight_sync.synthetic import random_state, rank_requests
from services.weight_sync.versions import VersionStore

CONFIG = ModelConfig.tiny()


def pushed(state, world=2, version=0):
    store = VersionStore()
    for rank in range(world):
        for req in rank_requests(state, version=version, rank=rank, world=world, max_message_bytes=4096):
            buf = store.buffer_for(req)
            for i, chunk in enumerate(req.shards):
                buf.add_chunk(rank, chunk, i)
            if req.last:
                buf.ranks_done.add(rank)
    return buf


class Corrupting:
    """Fills correctly (checksums computed), then flips one byte: corruption in transit."""

    def __init__(self, bucket):
        self._b = bucket
        self.index, self.count, self.nbytes, self.slices = (
            bucket.index,
            bucket.count,
            bucket.nbytes,
            bucket.slices,
        )

    def fill(self, dest):
        self._b.fill(dest)
        dest[self.nbytes // 2] = (dest[self.nbytes // 2] + 1) % 256


async def start_receivers(layout, n):
    engines, servers, endpoints = [], [], []
    for i in range(n):
        for rank in range(layout.tp_size):
            engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, layout, rank), rank=rank))
            server, address = await serve_engine(engine)
            engines.append(engine)
            servers.append(server)
            endpoints.append(Endpoint(address, rank, f"d{i}", same_host=True))
    return engines, servers, endpoints


async def deliver(transport, plan, buf, endpoints, version, corrupt_rank=None):
    results = {}
    for rank_plan in plan.ranks:
        eps = [e for e in endpoints if e.rank == rank_plan.rank]
        buckets = [PlannedBucket(s, rank_plan.dtype, buf.chunks) for s in rank_plan.buckets]
        if corrupt_rank == rank_plan.rank:
            buckets[len(buckets) // 2] = Corrupting(buckets[len(buckets) // 2])
        results.update(await transport.stage(version, eps, buckets, total_bytes=rank_plan.nbytes))
    return results


@pytest.mark.parametrize("kind", ["grpc", "shm"])
async def test_fan_out_to_two_deployments_and_commit(kind):
    layout = Layout(2, "fused")
    state = random_state(CONFIG)
    buf = pushed(state)
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    engines, servers, endpoints = await start_receivers(layout, 2)
    transport = GrpcTransport() if kind == "grpc" else ShmTransport(segment_bytes=4096, segments=2)
    try:
        results = await deliver(transport, plan, buf, endpoints, 0)
        assert all(r.error is None and r.complete for r in results.values()), results
        for ep in endpoints:
            assert await transport.commit(ep, 0) == 0
        for engine, ep in zip(engines, endpoints, strict=True):
            want = shard_state_dict(state, CONFIG, layout, ep.rank)
            assert all(torch.equal(engine.weights[n], want[n]) for n in want)
            # Bytes received by a rank are exactly its parameters (metadata aside).
            assert engine.receiver.bytes_received == plan.ranks[ep.rank].nbytes
        assert sum(e.receiver.bytes_received for e in engines[:2]) == plan.nbytes
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
    if kind == "shm":
        assert not [p for p in shm_dir().glob(f"{PREFIX}{os.getpid()}-*")], "segments left behind"


@pytest.mark.parametrize("kind", ["grpc", "shm"])
async def test_corrupted_byte_is_caught_and_old_version_keeps_serving(kind):
    layout = Layout(1, "hf")
    old, new = random_state(CONFIG, seed=1), random_state(CONFIG, seed=2)
    engines, servers, endpoints = await start_receivers(layout, 1)
    transport = GrpcTransport() if kind == "grpc" else ShmTransport(segment_bytes=4096, segments=2)
    try:
        buf0 = pushed(old, version=0)
        plan = build_deployment_plan(buf0.layout(), CONFIG, layout, 4096)
        assert all(r.error is None for r in (await deliver(transport, plan, buf0, endpoints, 0)).values())
        await transport.commit(endpoints[0], 0)
        buf1 = pushed(new, version=1)
        results = await deliver(transport, plan, buf1, endpoints, 1, corrupt_rank=0)
        (result,) = results.values()
        assert result.error is not None and "hash64" in str(result.error)
        assert result.error.code.name == "DATA_LOSS"
        engine = engines[0]
        assert engine.version == 0 and engine.stager.staged_version is None
        with pytest.raises(Exception, match="cannot commit"):
            await transport.commit(endpoints[0], 1)
        assert torch.equal(engine.weights["model.norm.weight"], old["model.norm.weight"])
        # The retry goes through.
        assert all(r.error is None for r in (await deliver(transport, plan, buf1, endpoints, 1)).values())
        await transport.commit(endpoints[0], 1)
        assert torch.equal(engine.weights["model.norm.weight"], new["model.norm.weight"])
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)


async def test_one_failing_receiver_does_not_stop_the_others():
    layout = Layout(1, "hf")
    buf = pushed(random_state(CONFIG))
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    engines, servers, endpoints = await start_receivers(layout, 2)
    engines[1].stager.serving_version = 5  # already newer: version 0 is stale there
    transport = GrpcTransport()
    try:
        results = await deliver(transport, plan, buf, endpoints, 0)
        assert results[endpoints[0]].error is None and results[endpoints[0]].complete
        err = results[endpoints[1]].error
        assert err is not None and err.code.name == "FAILED_PRECONDITION" and "not newer" in str(err)
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
