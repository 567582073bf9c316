"""Transports against real gRPC receivers (WeightOnlyEngine on 127.0.0.1): planned buckets arrive
intact over gRPC and shared memory, fan out to several receivers, and a byte corrupted in transit is
caught by the checksum while the receiver keeps serving its old version."""

from __future__ import annotations

import os

import pytest
import torch

from bench.harness.synthetic_weights import random_state, rank_requests
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params, shard_state_dict
from services.weight_sync.plan import build_deployment_plan
from services.weight_sync.planned_bucket import PlannedBucket
from services.weight_sync.transport import Delivery, Endpoint, GrpcTransport, ShmTransport
from services.weight_sync.versions import VersionStore
from services.weights import WeightOnlyEngine, WeightStager, serve_engine
from services.weights.shm import PREFIX, shm_dir

CONFIG = ModelConfig.tiny()


def pushed(state, world=2, version=0, store=None):
    """A version as weight-sync holds it; without a store its chunks stay in the pushed messages
    (no arena), so buckets take the copy-into-a-segment shm path."""
    store = store or VersionStore(shm=False)
    for rank in range(world):
        for req in rank_requests(state, version=version, rank=rank, world=world, max_message_bytes=4096):
            buf = store.buffer_for(req)
            for i, chunk in enumerate(req.shards):
                buf.add_chunk(rank, chunk, i)
            if req.last:
                buf.ranks_done.add(rank)
    return buf


class Wrapping:
    """A bucket standing for `bucket` (same index, count, size and slices); subclasses change how
    its bytes arrive."""

    def __init__(self, bucket):
        self._b = bucket
        self.index, self.count, self.nbytes, self.slices = (
            bucket.index,
            bucket.count,
            bucket.nbytes,
            bucket.slices,
        )


class Corrupting(Wrapping):
    """Fills correctly (checksums computed), then flips one byte: corruption in transit."""

    shareable = False

    def fill(self, dest):
        self._b.fill(dest)
        dest[self.nbytes // 2] = (dest[self.nbytes // 2] + 1) % 256

    def payload_parts(self, scratch):
        return None  # every byte through fill, so the corruption is sent

    def shm_slices(self):
        return None

    def copy_to(self, dests):
        raise TypeError("not shareable")


async def start_receivers(layout, n):
    engines, servers, endpoints = [], [], []
    for i in range(n):
        for rank in range(layout.tp_size):
            engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, layout, rank), rank=rank))
            server, address = await serve_engine(engine)
            engines.append(engine)
            servers.append(server)
            endpoints.append(Endpoint(address, rank, f"d{i}"))
    return engines, servers, endpoints


async def deliver(transport, plan, buf, endpoints, version, corrupt_rank=None):
    results = {}
    for rank_plan in plan.ranks:
        eps = [e for e in endpoints if e.rank == rank_plan.rank]
        buckets = [
            PlannedBucket(s, rank_plan.dtype, buf.chunks, buf.locations, buf.sums) for s in rank_plan.buckets
        ]
        if corrupt_rank == rank_plan.rank:
            buckets[len(buckets) // 2] = Corrupting(buckets[len(buckets) // 2])
        results.update(await transport.stage(Delivery(version, buckets, total_bytes=rank_plan.nbytes), eps))
    return results


async def deliver_and_commit(transport, plan, buf, endpoints, version):
    """Deliver `version` to every endpoint and commit it there: every receiver must take it."""
    results = await deliver(transport, plan, buf, endpoints, version)
    assert all(r.error is None and r.complete for r in results.values()), results
    for ep in endpoints:
        assert await transport.commit(ep, version) == version


@pytest.mark.parametrize("kind", ["grpc", "shm"])
async def test_fan_out_to_two_deployments_and_commit(kind):
    layout = Layout(2, "fused")
    state = random_state(CONFIG)
    buf = pushed(state)
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    engines, servers, endpoints = await start_receivers(layout, 2)
    transport = GrpcTransport() if kind == "grpc" else ShmTransport(segment_bytes=4096, segments=2)
    try:
        await deliver_and_commit(transport, plan, buf, endpoints, 0)
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
        await deliver_and_commit(transport, plan, buf0, endpoints, 0)
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
        await deliver_and_commit(transport, plan, buf1, endpoints, 1)
        assert torch.equal(engine.weights["model.norm.weight"], new["model.norm.weight"])
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)


@pytest.mark.parametrize("kind", ["grpc", "shm-in-place"])
async def test_one_failing_receiver_does_not_stop_the_others(kind):
    """The shm case reads the chunks in place, every bucket down one stream per receiver: the
    stream of the receiver that refuses breaks, the other's completes."""
    layout = Layout(1, "hf")
    store = VersionStore() if kind == "shm-in-place" else None  # with an arena: reshard-on-read
    state = random_state(CONFIG)
    buf = pushed(state, store=store)
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    assert len(plan.ranks[0].buckets) > 1
    engines, servers, endpoints = await start_receivers(layout, 2)
    engines[1].stager.serving_version = 5  # already newer: version 0 is stale there
    transport = GrpcTransport() if kind == "grpc" else ShmTransport(segment_bytes=4096, segments=2)
    try:
        results = await deliver(transport, plan, buf, endpoints, 0)
        assert results[endpoints[0]].error is None and results[endpoints[0]].complete
        err = results[endpoints[1]].error
        assert err is not None and err.code.name == "FAILED_PRECONDITION" and "not newer" in str(err)
        assert await transport.commit(endpoints[0], 0) == 0
        assert all(torch.equal(engines[0].weights[n], t) for n, t in state.items() if n in engines[0].weights)
        assert engines[1].stager.staged_version is None and engines[1].version == 5
        if kind == "shm-in-place":
            assert transport.pool.names() == []  # read in place: no bucket was copied into a segment
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        if store is not None:
            store.close()


# ------------------------------------------------------------ reshard-on-read (chunks in shm)
def _segments() -> list:
    return list(shm_dir().glob(f"{PREFIX}{os.getpid()}-*"))


@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "fused")])
async def test_reshard_on_read_sends_no_bucket_bytes_and_delivers_exact_weights(tp, naming):
    """Co-located receivers read their rectangles of the trainer chunks straight out of the
    version's arena: the sender copies no bucket (its pool stays empty), row-parallel slices are
    strided reads, and every rank holds exactly its shard."""
    layout = Layout(tp, naming)
    state = random_state(CONFIG)
    store = VersionStore(arena_segment_bytes=1 << 16)
    buf = pushed(state, store=store)
    assert len(buf.locations) == len(buf.chunks)
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    engines, servers, endpoints = await start_receivers(layout, 2)
    transport = ShmTransport(segment_bytes=4096, segments=2)
    try:
        await deliver_and_commit(transport, plan, buf, endpoints, 0)
        assert transport.pool.names() == []  # not one bucket was assembled on the sending side
        for engine, ep in zip(engines, endpoints, strict=True):
            want = shard_state_dict(state, CONFIG, layout, ep.rank)
            assert all(torch.equal(engine.weights[n], want[n]) for n in want)
            assert engine.receiver.bytes_received == plan.ranks[ep.rank].nbytes
        if tp == 2:
            strided = [
                sl
                for rp in plan.ranks
                for spec in rp.buckets
                for sl in PlannedBucket(spec, rp.dtype, buf.chunks, buf.locations, buf.sums).shm_slices()
                if sl.shm_rows
            ]
            assert strided, "row-parallel slices should be read as rectangles"
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        store.close()
    assert not _segments(), "segments left behind"


@pytest.mark.parametrize(
    "tp,naming,param,caught_by",
    [
        (1, "hf", "model.layers.0.mlp.gate_proj.weight", "receiver"),  # whole rows: only the receiver reads
        (2, "fused", "model.layers.0.self_attn.o_proj.weight", "weight-sync"),  # column blocks
    ],
)
async def test_byte_changed_in_shared_memory_after_verification_is_caught(tp, naming, param, caught_by):
    """Integrity on the in-place path: weight-sync verified each chunk's trainer hash64 on the bytes
    in its arena and recorded their row sums. A byte changed there afterwards is caught by the
    receiver's sum64 of what it copied (whole-row slices, expected sums derived from the landing
    record) or by weight-sync re-checking the rows of a column block before naming it; either way
    nothing is committed and the old version keeps serving."""
    layout = Layout(tp, naming)
    old, new = random_state(CONFIG, seed=1), random_state(CONFIG, seed=2)
    store = VersionStore(arena_segment_bytes=1 << 16)
    engines, servers, endpoints = await start_receivers(layout, 1)
    transport = ShmTransport(segment_bytes=4096, segments=2)
    try:
        buf0 = pushed(old, version=0, store=store)
        plan = build_deployment_plan(buf0.layout(), CONFIG, layout, 4096)
        await deliver_and_commit(transport, plan, buf0, endpoints, 0)
        buf1 = pushed(new, version=1, store=store)
        key = next(k for k in buf1.chunks if k[0] == param)
        chunk = buf1.chunks[key]
        chunk.view(torch.uint8)[1, chunk.shape[1] * 4 - 3] ^= 0x10  # in a column every rank reads
        results = await deliver(transport, plan, buf1, endpoints, 1)
        for ep, engine in zip(endpoints, engines, strict=True):
            err = results[ep].error
            assert err is not None and err.code.name == "DATA_LOSS", results
            if caught_by == "receiver":
                assert "sum64" in str(err) and "changed after it was verified" in str(err)
            else:
                assert "bytes in shared memory changed after they were verified" in str(err)
            assert engine.version == 0 and engine.stager.staged_version is None
            assert torch.equal(engine.weights["model.norm.weight"], old["model.norm.weight"])
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        store.close()


def test_chunk_checksum_is_verified_on_the_arena_copy_and_arenas_are_recycled():
    store = VersionStore(arena_segment_bytes=1 << 16)
    try:
        buf0 = pushed(random_state(CONFIG, seed=1), version=0, store=store)
        store.completed(buf0)
        names0 = {loc[0] for loc in buf0.locations.values()}
        assert names0 and all((shm_dir() / n).exists() for n in names0)
        buf0.hold()  # a delivery still reading version 0 keeps its arena
        buf1 = pushed(random_state(CONFIG, seed=2), version=1, store=store)
        store.completed(buf1)
        assert buf0.chunks and buf0.arena is not None
        buf0.release()
        assert buf0.arena is None and not buf0.chunks  # back to the pool for version 2
        buf2 = pushed(random_state(CONFIG, seed=3), version=2, store=store)
        assert {loc[0] for loc in buf2.locations.values()} & names0, "segments are reused"
    finally:
        store.close()
    assert not _segments()


# ------------------------------------------------------------ shared copies (several co-located deployments)
def _mapped_file(tensor: torch.Tensor) -> str:
    """The file whose mapping holds the tensor's memory ('' for anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


class CorruptedCopy(Wrapping):
    """Writes the shared copy correctly, then one byte of it flips before receivers verify it."""

    def expected_sums(self):
        return self._b.expected_sums()

    def copy_to(self, dests):
        self._b.copy_to(dests)
        largest = max(dests, key=lambda d: d.numel())
        largest[largest.numel() // 2] ^= 0x01


@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "fused")])
async def test_co_located_deployments_share_one_copy_and_serve_from_it(tp, naming):
    """Three deployments of one layout on weight-sync's host: the version is written once per rank,
    each deployment's weights are read-only views of that shared copy (no private copy), and each
    still holds exactly its shard and is credited exactly its bytes."""
    layout = Layout(tp, naming)
    state = random_state(CONFIG)
    store = VersionStore(arena_segment_bytes=1 << 16)
    buf = pushed(state, store=store)
    plan = build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
    engines, servers, endpoints = await start_receivers(layout, 3)
    transport = ShmTransport(segment_bytes=4096, segments=2)
    try:
        await deliver_and_commit(transport, plan, buf, endpoints, 0)
        for engine, ep in zip(engines, endpoints, strict=True):
            want = shard_state_dict(state, CONFIG, layout, ep.rank)
            assert all(torch.equal(engine.weights[n], want[n]) for n in want)
            assert engine.receiver.bytes_received == plan.ranks[ep.rank].nbytes
            for name in want:
                assert f"{PREFIX}{os.getpid()}-copy" in _mapped_file(engine.weights[name]), name
        rings = list(transport.shared._rings.values())
        assert len(rings) == tp and all([c.version for c in ring] == [0] for ring in rings)
        assert transport.pool.names() == []  # no per-bucket segment either
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        store.close()
    assert not _segments(), "segments left behind"


async def test_a_corrupted_shared_copy_fails_every_deployment_and_the_old_version_keeps_serving():
    """One flipped byte in the shared copy is caught by the one receiver that verifies that slice;
    since all of them would serve those bytes, all of them fail and keep serving version 0 (whose
    copy nothing overwrote), and the retry goes through."""
    layout = Layout(1, "hf")
    old, new = random_state(CONFIG, seed=1), random_state(CONFIG, seed=2)
    store = VersionStore(arena_segment_bytes=1 << 16)
    engines, servers, endpoints = await start_receivers(layout, 3)
    transport = ShmTransport(segment_bytes=4096, segments=2)
    try:
        buf0 = pushed(old, version=0, store=store)
        plan = build_deployment_plan(buf0.layout(), CONFIG, layout, 4096)
        await deliver_and_commit(transport, plan, buf0, endpoints, 0)
        buf1 = pushed(new, version=1, store=store)
        rank_plan = plan.ranks[0]
        buckets = [
            PlannedBucket(s, rank_plan.dtype, buf1.chunks, buf1.locations, buf1.sums)
            for s in rank_plan.buckets
        ]
        buckets[1] = CorruptedCopy(buckets[1])
        results = await transport.stage(Delivery(1, buckets, total_bytes=rank_plan.nbytes), endpoints)
        errors = [str(r.error) for r in results.values()]
        assert all(r.error is not None and r.error.code.name == "DATA_LOSS" for r in results.values()), errors
        (caught,) = [e for e in errors if "failed verification" not in e]  # verified once, by one receiver
        assert "sum64" in caught and "in shared copy" in caught, errors
        for engine in engines:
            assert engine.version == 0 and engine.stager.staged_version is None
            assert all(torch.equal(engine.weights[n], t) for n, t in old.items() if n in engine.weights)
        await deliver_and_commit(transport, plan, buf1, endpoints, 1)
        assert all(torch.equal(engines[2].weights[n], t) for n, t in new.items() if n in engines[2].weights)
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        store.close()


async def test_a_copy_any_deployment_still_depends_on_is_never_overwritten():
    """Deployments fall behind at different paces: A commits every version, B skips one, C never
    commits. The ring gives each new version a copy none of them serves, holds as rollback point or
    has staged; once all three copies are in use the version goes by per-receiver copy instead,
    and what A and B serve never changes under them."""
    layout = Layout(1, "hf")
    states = [random_state(CONFIG, seed=10 + v) for v in range(4)]
    store = VersionStore(arena_segment_bytes=1 << 16)
    engines, servers, (a, b, c) = await start_receivers(layout, 3)
    transport = ShmTransport(segment_bytes=4096, segments=2)

    def serves(engine, state) -> bool:
        return all(torch.equal(engine.weights[n], t) for n, t in state.items() if n in engine.weights)

    try:
        plan = None
        for v, commit_to in enumerate([(a, b), (a,), (a, b), (a, b, c)]):
            buf = pushed(states[v], version=v, store=store)
            plan = plan or build_deployment_plan(buf.layout(), CONFIG, layout, 4096)
            results = await deliver(transport, plan, buf, [a, b, c], v)
            assert all(r.error is None and r.complete for r in results.values()), results
            for ep in commit_to:
                await transport.commit(ep, v)
            store.completed(buf)
            # A serves v, B the last version it committed: both intact after every later staging
            assert serves(engines[0], states[v])
            assert serves(engines[1], states[v if b in commit_to else v - 1])
        (ring,) = transport.shared._rings.values()
        # versions 0, 1, 2 each had a free copy; for 3 all were in use (A: 2 + rollback 1, B: 2 +
        # rollback 0, C: 2 staged), so version 3 went by per-receiver copies and the ring kept them
        assert sorted(c.version for c in ring) == [0, 1, 2]
        assert serves(engines[2], states[3])
    finally:
        await transport.close()
        for s in servers:
            await s.stop(None)
        store.close()
