"""Canary deployments with real replicas: the router's DeploymentManager starts a deployment of two
InferenceReplica Ray actors with `canary = true` and registers it with a real weight-sync (one target,
both replicas, the first the canary). A training-step-sized change reaches both replicas; weights x100
(every checksum valid) are served by the canary only, rolled back there and never committed on the
other replica, announced on the bus as WeightsRejected (which the router's WeightsPublished follower
skips), and the router does not mistake the rollback for a restart; the next good version goes through.
A tp=2 replica rolls back across both of its ranks."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import grpc
import pytest
import torch

from bench.harness.synthetic_weights import push_version, random_state
from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.inference_router.config import RouterConfig
from services.inference_router.deployments import DeploymentManager
from services.inference_router.router import Router
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.bus.subjects import EVENT_HEADER, WEIGHTS_REJECTED
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.interceptors import ServerInterceptor
from services.modeling.config import ModelConfig
from services.weight_sync import canary
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.service import attach_state, make

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONFIG = ModelConfig.tiny()
PROMPTS = [[5, 9, 14, 3, 22], [40, 2, 7], [11, 11, 30, 8, 1, 19]]


async def push(stub, state, version):
    await push_version(stub, state, CONFIG, version)


async def settle(stub, predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        reply = await stub.GetVersion(weightsync_pb2.GetVersionRequest())
        targets = [t for t in reply.targets if t.deployment == "canaried"]
        if len(targets) == 1 and predicate(targets[0]):
            return targets[0]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"target did not settle: {targets}")
        await asyncio.sleep(0.05)


def same(a, b, tol=1e-4):
    """Same greedy tokens, log-probs equal up to float noise (batch composition changes rounding)."""
    return len(a) == len(b) and all(
        ta == tb and len(la) == len(lb) and all(abs(x - y) <= tol for x, y in zip(la, lb, strict=True))
        for (ta, la), (tb, lb) in zip(a, b, strict=True)
    )


async def weights_events(nats_url, run):
    """The WeightsRejected events of a run (headers tell them from WeightsPublished on the subject)."""
    bus = await Bus.connect(nats_url, name="canary-test")
    try:
        consumer = await bus.pull_consumer(subjects.WEIGHTS, f"test-{run}", subjects.weights(run))
        out = []
        for delivery in await consumer.fetch(batch=64, timeout=2.0):
            if delivery.headers.get(EVENT_HEADER) == WEIGHTS_REJECTED:
                out.append(delivery.parse(events_pb2.WeightsRejected))
            await delivery.ack()
        return out
    finally:
        await bus.close()


async def run_errors(nats_url, run):
    """The RunErrors components reported to a run."""
    bus = await Bus.connect(nats_url, name="canary-test")
    try:
        consumer = await bus.pull_consumer(subjects.RUN_EVENTS, f"test-errors-{run}", subjects.events(run))
        return [d.parse(events_pb2.RunError) for d in await consumer.fetch(batch=64, timeout=2.0)]
    finally:
        await bus.close()


def nudged(state, seed, scale=1e-3):
    """What a training step does to weights: a small change everywhere."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in state.items()}


async def test_canary_deployment_of_real_replicas_rolls_back_bad_weights(ray_client, nats_url):
    run = f"canary-{uuid.uuid4().hex[:6]}"
    ws_cfg = WeightSyncConfig(nats_url=nats_url, run_id=run, bucket_bytes=1 << 16, retry_backoff_s=0.05)
    servicer = make(ws_cfg)
    await attach_state(servicer, ws_cfg)
    ws_server = grpc.aio.server(interceptors=[ServerInterceptor("weight-sync", lambda: None)])
    weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, ws_server)
    ws_address = f"127.0.0.1:{ws_server.add_insecure_port('127.0.0.1:0')}"
    await ws_server.start()
    channel = grpc.aio.insecure_channel(ws_address)
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

    cfg = RouterConfig(
        weight_sync_address=ws_address,
        namespace=run,
        run_id=run,
        request_timeout_s=30,
    )
    router = Router()
    manager = DeploymentManager(router, cfg)
    router._on_replica_restarted = manager.request_sync
    spec = DeploymentSpec(
        name="canaried",
        num_cpus=0.5,
        replicas=2,
        max_model_len=64,
        max_batch_size=4,
        canary=True,
        canary_max_logprob_drift=0.5,
        canary_tokens_per_prompt=6,
    )
    engine_channels: list[grpc.aio.Channel] = []
    try:
        await manager.start(spec, ready_timeout_s=60)
        await manager.follow_weight_events(nats_url)
        names = ["canaried-r0", "canaried-r1"]
        # ONE target of both replicas (a deployment of an earlier test may still be unregistering)
        targets = (await ws.GetVersion(weightsync_pb2.GetVersionRequest())).targets
        assert [t.deployment for t in targets if t.deployment.startswith("canaried")] == ["canaried"]

        async def status(name):
            return await manager.actors[name].status.remote()

        stubs = {}
        for name in names:
            engine_channels.append(grpc.aio.insecure_channel((await status(name)).address))
            stubs[name] = inference_pb2_grpc.InferenceEngineServiceStub(engine_channels[-1])

        async def versions():
            return [(await status(n)).weight_version for n in names]

        async def answers(name):
            return await canary.golden_answers(stubs[name], PROMPTS, 6)

        v0 = random_state(CONFIG, seed=3)
        await push(ws, v0, 0)  # nothing to compare with yet: both replicas switch
        await settle(ws, lambda t: t.version == 0 and t.state == "ready")
        assert await versions() == [0, 0]

        v1 = nudged(v0, seed=1)
        await push(ws, v1, 1)
        target = await settle(ws, lambda t: t.version == 1 and t.state == "ready")
        assert 0 < target.canary_drift < 0.5 and target.canary_rejected_version == -1
        assert await versions() == [1, 1]
        good = await answers("canaried-r1")

        bad = {n: t * 100 for n, t in v1.items()}  # every checksum is valid, the model is garbage
        await push(ws, bad, 2)
        target = await settle(ws, lambda t: t.canary_rejected_version == 2 and t.state == "failed")
        assert target.version == 1 and "canary rejected version 2" in target.last_error
        assert await versions() == [1, 1]  # r0 rolled back, r1 never switched
        r0, r1 = await status("canaried-r0"), await status("canaried-r1")
        assert r0.rolled_back_version == 2 and r1.rolled_back_version == -1
        assert r1.staged_version == -1  # r1 dropped what it staged
        assert same(await answers("canaried-r0"), good)  # the canary answers exactly as v1 again
        assert router.announced["canaried"] == 1  # the router took the rejection for no new version
        rejected = await weights_events(nats_url, run)
        assert [(e.version, e.deployment) for e in rejected] == [(2, "canaried")]
        assert rejected[0].drift == -1 or rejected[0].drift > 0.5
        # ...and the run is told, so a run that stops progressing names weight-sync and why.
        reported = [e for e in await run_errors(nats_url, run) if e.component == "weight-sync"]
        assert reported and "deployment canaried: canary rejected version 2" in reported[-1].message

        # Had a status poll seen the canary at version 2, the step back to 1 looks like a restart;
        # the manager recognises the rollback and the replica stays routable, without a resync.
        replica = router.replicas["canaried-r0"]
        router.observe_status(replica, dataclasses.replace(r0, weight_version=2))
        router.observe_status(replica, r0)
        assert replica.resync_to_version == 2 and not replica.routable  # taken for a restart at first
        for _ in range(100):
            if replica.routable:
                break
            await asyncio.sleep(0.05)
        assert replica.routable and replica.weight_version == 1 and replica.resync_to_version is None

        v3 = nudged(v1, seed=3)
        await push(ws, v3, 3)
        await settle(ws, lambda t: t.version == 3 and t.state == "ready")
        assert await versions() == [3, 3]
        assert same(await answers("canaried-r0"), await answers("canaried-r1"))
    finally:
        await manager.stop()
        for ch in engine_channels:
            await ch.close()
        await servicer.deliverer.close()
        await channel.close()
        await ws_server.stop(None)
        if servicer.state is not None:
            await servicer.state.bus.close()


async def test_tp2_replica_rolls_back_on_every_rank(ray_client):
    import ray

    from services.inference_router.replica_actor import InferenceReplica

    spec = DeploymentSpec(name="tp2", num_cpus=0.5, tensor_parallel=2, max_model_len=48, max_batch_size=4)
    actor = InferenceReplica.options(num_cpus=0.5).remote(spec=spec, replica="tp2-r0")
    try:
        address = await actor.address.remote()
        v0 = random_state(CONFIG, seed=5)
        await actor.load_state_dict.remote(0, v0, CONFIG.to_dict())
        async with grpc.aio.insecure_channel(address) as ch:
            stub = inference_pb2_grpc.InferenceEngineServiceStub(ch)
            before = await canary.golden_answers(stub, PROMPTS, 5)
            await actor.load_state_dict.remote(1, {n: t * 100 for n, t in v0.items()})
            assert not same(await canary.golden_answers(stub, PROMPTS, 5), before)
            reply = await stub.RollbackWeights(inference_pb2.RollbackWeightsRequest(version=1))
            assert reply.weight_version == 0
            assert same(await canary.golden_answers(stub, PROMPTS, 5), before)  # both ranks hold v0 again
            # A retried rollback is answered with the version served; an older one cannot go further back.
            assert (
                await stub.RollbackWeights(inference_pb2.RollbackWeightsRequest(version=1))
            ).weight_version == 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RollbackWeights(inference_pb2.RollbackWeightsRequest(version=0))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # Generation keeps working and the next version goes through.
            await actor.load_state_dict.remote(2, v0)
            resp = await stub.Generate(
                inference_pb2.GenerateRequest(
                    prompt_token_ids=PROMPTS[0],
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3),
                )
            )
            assert resp.completions[0].weight_version == 2
    finally:
        await actor.shutdown.remote()
        ray.kill(actor)
