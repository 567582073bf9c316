"""A disaggregated CPU deployment of real replicas (InferenceReplica Ray actors, each with its own
engine and gRPC server) behind the real router, receiving its weights only from a real weight-sync
(in this process), beside a co-located deployment of the same model:

- parity: the same seeded requests give the same tokens and log-probs on both, and on the
  disaggregated one every request was prefilled by its prefill worker and decoded by its decode
  worker from KV handed over in shared memory;
- versions: while weight-sync delivers new versions under load (the deployment is ONE weight-sync
  target: staged on every worker, committed on all), no token of any request is sampled from KV of
  another version than its own (Completion.kv_versions == token_versions, asserted for every token
  of every completion), and the requests that met a swap show it;
- failover: the prefill worker is killed under load; every request still completes (its decode
  worker recomputes what it cannot read, or the router moves the prefill), and the restarted
  worker is resynced."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch

from bench.harness.synthetic_weights import push_version, random_state
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.inference_router.config import RouterConfig
from services.inference_router.deployments import DeploymentManager
from services.inference_router.router import Router
from services.kit.config.recipe import DeploymentSpec, DisaggregationSection
from services.kit.rpc.interceptors import ServerInterceptor
from services.modeling.config import ModelConfig
from services.weight_sync.config import WeightSyncConfig
from services.weight_sync.service import attach_state, make

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIG = ModelConfig.tiny()


def nudged(state, seed, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in state.items()}


def request(i: int, deployment: str, max_tokens: int = 12, n: int = 2) -> inference_pb2.GenerateRequest:
    prompt = [(7 * i + 3 * j) % (CONFIG.vocab_size - 1) + 1 for j in range(4 + 3 * (i % 5))]
    return inference_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.9, max_tokens=max_tokens, n=n, seed=1000 + i),
        deployment=deployment,
        request_id=f"q{i}",
    )


async def settle(stub, deployments, version, timeout=60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        targets = {
            t.deployment: t for t in (await stub.GetVersion(weightsync_pb2.GetVersionRequest())).targets
        }
        if all(
            d in targets and targets[d].version >= version and targets[d].state == "ready"
            for d in deployments
        ):
            return targets
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"targets did not reach version {version}: {targets}")
        await asyncio.sleep(0.05)


async def routable(router, names, version, timeout=30.0, not_at=""):
    """Until the router routes to every replica named, at `version` or newer (and not at the
    address `not_at`: a restarted replica's process listens on a new one)."""
    deadline = asyncio.get_running_loop().time() + timeout

    def ready(r) -> bool:
        return r.routable and r.weight_version >= version and r.address != not_at

    while not all(ready(router.replicas[n]) for n in names):
        assert asyncio.get_running_loop().time() < deadline, [router.replicas[n] for n in names]
        await asyncio.sleep(0.05)


def assert_versions_consistent(responses) -> set[int]:
    """Every token of every completion was sampled from KV of its own version; the versions seen."""
    seen = set()
    for r in responses:
        for c in r.completions:
            assert len(c.kv_versions) == len(c.token_versions) == len(c.token_ids), r
            assert list(c.kv_versions) == list(c.token_versions), (r.replica, r.kv_transfer, c)
            seen |= set(c.token_versions)
    return seen


async def test_a_disaggregated_deployment_matches_colocated_and_never_decodes_kv_of_another_version(
    ray_client, nats_url
):
    import ray

    run = f"pd-{uuid.uuid4().hex[:6]}"
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
        weight_sync_address=ws_address, namespace=run, run_id=run, request_timeout_s=60, status_interval_s=0.2
    )
    router = Router(config=cfg)
    manager = DeploymentManager(router, cfg)
    router._on_replica_restarted = manager.request_sync
    common = {"num_cpus": 0.25, "max_model_len": 96, "max_batch_size": 16}
    pd = DeploymentSpec(
        name="pd",
        disaggregation=DisaggregationSection(prefill_workers=1, decode_workers=1, retune=False),
        **common,
    )
    co = DeploymentSpec(name="co", **common)
    try:
        await asyncio.gather(manager.start(pd, ready_timeout_s=90), manager.start(co, ready_timeout_s=90))
        await manager.follow_weight_events(nats_url)
        router.start_polling()
        targets = (await ws.GetVersion(weightsync_pb2.GetVersionRequest())).targets
        assert sorted(t.deployment for t in targets) == ["co-r0", "pd"]  # ONE target of both workers
        assert [r.role for r in router.deployments["pd"].replicas] == ["prefill", "decode"]

        v0 = random_state(CONFIG, seed=3)
        await push_version(ws, v0, CONFIG, 0)
        await settle(ws, ["pd", "co-r0"], 0)
        await routable(router, ["pd-r0", "pd-r1", "co-r0"], 0)

        # ---- parity: one request at a time, the same seeds on both deployments
        for i in range(6):
            got = await router.generate(request(i, "pd"))
            want = await router.generate(request(i, "co"))
            assert (got.replica, got.prefill_replica, got.kv_transfer) == ("pd-r1", "pd-r0", "shm")
            assert [list(c.token_ids) for c in got.completions] == [
                list(c.token_ids) for c in want.completions
            ]
            for a, b in zip(got.completions, want.completions, strict=True):
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        parity_requests = [await router.generate(request(i, "pd")) for i in range(6, 9)]
        assert_versions_consistent(parity_requests)

        # ---- versions: two new versions delivered while requests keep coming (8 in flight)
        async def load_until(done: asyncio.Event, start: int) -> list[inference_pb2.GenerateResponse]:
            out, i = [], start
            while not done.is_set():
                out.append(await router.generate(request(i, "pd", max_tokens=40)))
                i += 8
            return out

        async def updates(done: asyncio.Event) -> None:
            state = v0
            for version in (1, 2):
                await asyncio.sleep(0.3)
                state = nudged(state, seed=version)
                await push_version(ws, state, CONFIG, version)
                await settle(ws, ["pd"], version)
            await asyncio.sleep(0.3)
            done.set()

        done = asyncio.Event()
        *loads, _ = await asyncio.gather(*(load_until(done, k) for k in range(8)), updates(done))
        responses = [r for load in loads for r in load]
        seen = assert_versions_consistent(responses)
        assert seen == {0, 1, 2}  # the requests spanned both updates
        straddled = [r for r in responses if len({v for c in r.completions for v in c.token_versions}) > 1]
        transfers = {r.kv_transfer for r in responses}
        assert transfers <= {"shm", "recompute"} and "shm" in transfers
        print(f"{len(straddled)} of {len(responses)} requests met a swap mid-decode; transfers {transfers}")

        # ---- failover: the prefill worker dies under load, no request is lost
        killed_at = router.replicas["pd-r0"].address

        async def kill_prefill():
            await asyncio.sleep(0.2)
            ray.kill(manager.actors["pd-r0"], no_restart=False)

        results = await asyncio.gather(
            *(router.generate(request(100 + i, "pd", max_tokens=30)) for i in range(12)), kill_prefill()
        )
        responses = results[:-1]
        assert all(len(c.token_ids) == 30 for r in responses for c in r.completions)
        assert_versions_consistent(responses)
        # The restarted prefill worker is resynced to the deployment's version and prefills again.
        await routable(router, ["pd-r0"], 2, timeout=60, not_at=killed_at)
        after = await router.generate(request(200, "pd"))
        workers = [(await manager.actors[n].status.remote()).engine for n in ("pd-r0", "pd-r1")]
        assert (after.replica, after.prefill_replica, after.kv_transfer) == ("pd-r1", "pd-r0", "shm"), workers
    finally:
        await router.close()
        await manager.stop()
        await channel.close()
        await servicer.deliverer.close()
        await ws_server.stop(grace=None)
