"""Several runs on one weight-sync: versions are numbered per run, a run's version is scheduled only
to that run's targets (and to targets of no run), GetVersion reports per run, UnregisterTarget
stops deliveries, drops the deployment's metric series and frees a run's bytes when its last
target leaves."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import REGISTRY

from bench.harness.synthetic_weights import random_state, rank_requests
from looprl.weightsync.v1 import weightsync_pb2 as ws
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.deliver import Deliverer
from services.weight_sync.service import make
from services.weight_sync.servicer import WeightSyncServicer
from services.weight_sync.targets import target_from_request
from services.weight_sync.versions import VersionBuffer, VersionStore
from services.weights import WeightOnlyEngine, WeightStager, serve_engine

CONFIG = ModelConfig.tiny()
STATE = random_state(CONFIG)
CONFIG_JSON = json.dumps(CONFIG.to_hf_dict())


def push(store: VersionStore, version: int, run_id: str = "") -> VersionBuffer:
    buf = None
    for req in rank_requests(
        STATE, version=version, rank=0, world=1, run_id=run_id, model_config_json=CONFIG_JSON
    ):
        buf = store.buffer_for(req)
        for i, chunk in enumerate(req.shards):
            buf.add_chunk(0, chunk, i)
        if req.last:
            buf.ranks_done.add(0)
    assert buf is not None and buf.complete
    store.completed(buf)
    return buf


def registration(deployment: str, run_id: str = "") -> ws.RegisterTargetRequest:
    return ws.RegisterTargetRequest(
        deployment=deployment,
        run_id=run_id,
        layout=ws.TargetLayout(tensor_parallel=1, naming="hf"),
        ranks=[ws.TargetRank(rank=0, address=f"127.0.0.1:1/{deployment}")],
    )


def test_two_runs_each_have_their_own_version_numbers():
    store = VersionStore(shm=False, default_run="main")
    a3 = push(store, 3, "run-a")
    b3 = push(store, 3, "run-b")  # the same number in another run is another version
    assert a3 is not b3 and (a3.run_id, b3.run_id) == ("run-a", "run-b")
    push(store, 4, "run-a")
    with pytest.raises(
        FailedPrecondition,
        match=r"version: 3 is not newer than the latest complete version 4 \(of run 'run-a'\)",
    ):
        push(store, 3, "run-a")
    assert store.run("run-a").latest_version == 4 and store.run("run-b").latest_version == 3
    assert store.run("run-b").latest is b3  # run-a's newer version did not retire run-b's bytes
    assert b3.arena is None and not b3._retired


def test_a_push_without_run_belongs_to_the_default_run_and_is_the_single_run_view():
    store = VersionStore(shm=False, default_run="main")
    push(store, 2)
    assert store.run("main").latest_version == 2 and store.latest_version == 2
    push(store, 7, "other")
    assert store.latest_version == 2  # the default run's, whatever another run pushed
    assert store.serving("").latest_version == 7  # a target of no run takes the last run that pushed

    only = VersionStore(shm=False, default_run="main")
    push(only, 5, "solo")
    assert only.latest_version == 5 and only.latest is only.run("solo").latest


def test_freeing_a_run_drops_its_bytes_but_not_its_number():
    store = VersionStore(shm=False)
    buf = push(store, 1, "run-a")
    store.free("run-a")
    assert store.run("run-a").latest is None and buf._retired
    with pytest.raises(FailedPrecondition):
        push(store, 0, "run-a")
    push(store, 1, "run-a")  # the lost latest version may be pushed again, as after a restart


def deliverer_recording(store: VersionStore) -> tuple[Deliverer, list[tuple[str, int, list[str]]]]:
    deliverer = Deliverer(store)
    started: list[tuple[str, int, list[str]]] = []

    async def record(buf, targets, speculative, forced=False):
        started.append((buf.run_id, buf.version, sorted(t.deployment for t in targets)))

    deliverer._deliver = record
    return deliverer, started


async def test_a_runs_version_is_scheduled_only_to_its_targets_and_to_targets_of_no_run():
    store = VersionStore(shm=False)
    deliverer, started = deliverer_recording(store)
    for name, run in (("a/actor", "run-a"), ("b/actor", "run-b"), ("shared", "")):
        deliverer.targets[name] = target_from_request(registration(name, run))
    deliverer.schedule(push(store, 0, "run-a"))
    deliverer.schedule(push(store, 0, "run-b"))
    await deliverer.idle(5)
    # every target sits on one host (no host ids): one delivery per version with its receivers; a
    # target of no run takes whichever run pushes (the single-run stack)
    assert started == [("run-a", 0, ["a/actor", "shared"]), ("run-b", 0, ["b/actor", "shared"])]

    started.clear()
    deliverer.schedule(store.run("run-a").latest, force=deliverer.targets["b/actor"])
    await deliverer.idle(5)
    assert started == []  # even a forced sync never sends one run's weights to another's target
    await deliverer.close()


async def test_unregistered_target_gets_no_more_versions_and_errors_name_the_field():
    servicer: WeightSyncServicer = make(WeightSyncConfig(use_bus=False, run_id="main"))
    servicer.store.arenas = None  # no shared memory needed: the recording deliverer sends nothing
    await servicer.deliverer.close()
    servicer.deliverer, started = deliverer_recording(servicer.store)
    for name, run in (("a/actor", "run-a"), ("a/critic", "run-a"), ("b/actor", "run-b")):
        await servicer.RegisterTarget(registration(name, run), None)
    buf = push(servicer.store, 0, "run-a")

    with pytest.raises(InvalidArgument, match=r"^deployment: must not be empty"):
        await servicer.UnregisterTarget(ws.UnregisterTargetRequest(), None)
    with pytest.raises(NotFound, match="deployment: 'a/nope'"):
        await servicer.UnregisterTarget(ws.UnregisterTargetRequest(deployment="a/nope"), None)

    failed_syncs = "looprl_weight_sync_failed_syncs_total"
    assert REGISTRY.get_sample_value(failed_syncs, {"deployment": "a/actor"}) == 0.0
    await servicer.UnregisterTarget(ws.UnregisterTargetRequest(deployment="a/actor"), None)
    assert REGISTRY.get_sample_value(failed_syncs, {"deployment": "a/actor"}) is None  # series gone
    servicer.deliverer.schedule(buf)
    await servicer.deliverer.idle(5)
    assert started == [("run-a", 0, ["a/critic"])]
    assert servicer.store.run("run-a").latest is buf  # run-a still has a target: its bytes stay

    await servicer.UnregisterTarget(ws.UnregisterTargetRequest(deployment="a/critic"), None)
    assert servicer.store.run("run-a").latest is None and buf._retired

    status = await servicer.GetVersion(ws.GetVersionRequest(run_id="run-a"), None)
    assert (status.latest_version, list(status.targets)) == (0, [])
    status = await servicer.GetVersion(ws.GetVersionRequest(run_id="run-b"), None)
    assert status.latest_version == -1
    assert [(t.deployment, t.run_id) for t in status.targets] == [("b/actor", "run-b")]
    await servicer.deliverer.close()


async def test_a_delivery_shared_with_an_unregistered_target_still_commits_on_the_others():
    store = VersionStore(shm=False)
    deliverer = Deliverer(store, bucket_bytes=4096)
    failures: list[str] = []

    async def on_failed(t, run_id):
        failures.append(t.deployment)

    deliverer.on_failed = on_failed
    engines, servers = {}, []
    for name in ("r/actor", "r/critic"):
        engine = WeightOnlyEngine(WeightStager(rank_params(CONFIG, Layout(1, "hf"), 0), rank=0))
        server, address = await serve_engine(engine)
        engines[name] = engine
        servers.append(server)
        req = registration(name, "r")
        req.ranks[0].address = address
        deliverer.targets[name] = target_from_request(req)
    stage = engines["r/critic"].receiver._stage

    def slow_stage(request, reader):  # the critic's link is slow: its unregistering finds bytes in flight
        time.sleep(0.02)
        return stage(request, reader)

    engines["r/critic"].receiver._stage = slow_stage
    try:
        # Both targets sit on one (unnamed) host: one delivery streams the version to both.
        deliverer.schedule(push(store, 0, "r"))
        deadline = time.monotonic() + 20
        while engines["r/critic"].stager.bytes_staged == 0:
            assert time.monotonic() < deadline, "the critic never started staging"
            await asyncio.sleep(0.01)
        deliverer.unregister("r/critic")
        await deliverer.idle(30)
        assert engines["r/actor"].commits == [0]
        assert engines["r/critic"].commits == []  # abandoned: staged perhaps, never committed
        assert failures == [] and deliverer.targets["r/actor"].state == "ready"
    finally:
        await deliverer.close()
        for server in servers:
            await server.stop(None)
