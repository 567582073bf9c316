"""Runs side by side on one router: each run record in the KV bucket "runs" gets its own replicas of
a tiny Qwen2 (real Ray actors on the session's Ray head), its requests are answered only there, and
a run that ends gives its replicas back to Ray while the others keep serving.

The router runs in this process (Router, DeploymentManager and the run watcher wired as service.py
wires them) against its own nats-server, so no other test's run records reach it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.harness.local_fleet import tiny_checkpoint
from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from looprl.inference.v1 import inference_pb2
from services.kit.bus import subjects
from services.kit.config.recipe import RunRecord
from services.kit.local.infra import NatsServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RECIPE = """
[[deployments]]
name = "gen"
num_cpus = 0.5
replicas = 1
max_model_len = 128
max_batch_size = 4
"""


@pytest.fixture
def own_nats(tmp_path):
    server = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    yield server.url
    server.stop()


def _req(run_id: str, **kw) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=[4, 5, 6], sampling=common_pb2.SamplingParams(max_tokens=3), run_id=run_id, **kw
    )


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.2)


def _actor_exists(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def test_each_run_gets_its_own_replicas_and_an_ended_run_frees_them(ray_client, own_nats):
    from services.inference_router.config import RouterConfig
    from services.inference_router.deployments import DeploymentManager
    from services.inference_router.runs import RunDeployments
    from services.inference_router.service import build_router
    from services.inference_router.servicer import InferenceRouterServicer
    from services.kit.bus.client import Bus

    namespace = f"router-runs-{free_port()}"
    config, weights = tiny_checkpoint(seed=0)

    async def main() -> None:
        bus = await Bus.connect(own_nats, name="test")
        try:
            await served_side_by_side(bus)
        finally:
            await bus.close()

    async def served_side_by_side(bus) -> None:
        await bus.ensure_streams()
        kv = await bus.kv("runs")
        cfg = RouterConfig(namespace=namespace, status_interval_s=0.2, request_timeout_s=60)
        router = build_router(cfg)
        manager = DeploymentManager(router, cfg)
        runs = RunDeployments(manager, router)
        servicer = InferenceRouterServicer(router, manager)
        router.start_polling()
        try:
            await runs.start(bus)
            for run_id, state in (("run-a", "pending"), ("run-b", "running"), ("run-q", "queued")):
                await kv.put(run_id, RunRecord(run_id=run_id, recipe_toml=RECIPE, state=state).to_json())
            await _until(lambda: "run-a" in runs.served, 10, "run-a seen")
            # A request of run-a sent before its replicas serve waits for them, however long they load.
            early = asyncio.ensure_future(router.generate(_req("run-a"), timeout_s=200))
            await _until(
                lambda: {"run-a/gen", "run-b/gen"} <= set(router.deployments), 150, "both runs' replicas up"
            )
            listing = await servicer.ListDeployments(inference_pb2.ListDeploymentsRequest(), None)
            assert {(d.name, d.run_id) for d in listing.deployments} == {
                ("run-a/gen", "run-a"),
                ("run-b/gen", "run-b"),
            }
            assert not early.done()  # replicas up, but without weights yet
            actors = {run: f"{run}/gen/0" for run in ("run-a", "run-b")}
            import ray

            for name in actors.values():
                await ray.get_actor(name, namespace=namespace).load_state_dict.remote(
                    0, weights, config.to_dict()
                )
            answered = await early
            assert (answered.deployment, answered.replica) == ("run-a/gen", "run-a/gen-r0")
            assert answered.completions[0].weight_version == 0
            for run_id in ("run-a", "run-b"):
                for reply in [await router.generate(_req(run_id)) for _ in range(3)]:
                    assert reply.deployment == f"{run_id}/gen"
            pinned = await router.generate(_req("run-b", deployment="gen"))
            assert pinned.deployment == "run-b/gen"
            # A queued run starts nothing.
            assert not _actor_exists("run-q/gen/0", namespace)

            await kv.put("run-a", RunRecord(run_id="run-a", recipe_toml=RECIPE, state="stopped").to_json())
            await _until(lambda: "run-a/gen" not in router.deployments, 30, "run-a's deployment removed")
            await _until(
                lambda: not _actor_exists(actors["run-a"], namespace), 30, "run-a's replica actor killed"
            )
            listing = await servicer.ListDeployments(inference_pb2.ListDeploymentsRequest(), None)
            assert [d.name for d in listing.deployments] == ["run-b/gen"]
            assert (await router.generate(_req("run-b"))).deployment == "run-b/gen"
            assert _actor_exists(actors["run-b"], namespace)

            # Weight events name a run's deployments by their scoped names, on the run's subject.
            await manager.follow_weight_events(own_nats)
            for run_id, version in (("run-a", 7), ("run-b", 5)):
                event = events_pb2.WeightsPublished(deployment="run-b/gen", version=version)
                await bus.publish(subjects.weights(run_id), event, msg_id=f"{run_id}-{version}")
            await _until(lambda: router.announced.get("run-b/gen") == 5, 10, "run-b's event applied")
            await asyncio.sleep(0.3)
            assert router.announced["run-b/gen"] == 5  # run-a's event never applies to run-b
        finally:
            await runs.stop()
            await router.close()
            await manager.stop()

        # A restarted router serves the active runs again and starts nothing for ended ones.
        router = build_router(cfg)
        manager = DeploymentManager(router, cfg)
        runs = RunDeployments(manager, router)
        router.start_polling()
        try:
            await _until(lambda: not _actor_exists(actors["run-b"], namespace), 30, "old replicas gone")
            await runs.start(bus)
            await _until(lambda: "run-b/gen" in router.deployments, 150, "run-b's replicas up again")
            await asyncio.sleep(0.5)
            assert set(router.deployments) == {"run-b/gen"}
            assert not _actor_exists(actors["run-a"], namespace)
        finally:
            await runs.stop()
            await router.close()
            await manager.stop()

    asyncio.run(main())


def test_the_router_process_serves_the_runs_it_finds_on_its_bus(ray_head, own_nats, tmp_path):
    """The service's own wiring: no static deployment, Ray joined only when a run needs replicas."""
    import grpc

    from bench.harness.local_fleet import RouterProcess
    from looprl.inference.v1 import inference_pb2_grpc
    from services.kit.bus.client import Bus

    router = RouterProcess([], tmp_path / "router.log", nats_url=own_nats, status_interval_s=0.2)

    def listing(stub) -> set[tuple[str, str]]:
        reply = stub.ListDeployments(inference_pb2.ListDeploymentsRequest(), timeout=5)
        return {(d.name, d.run_id) for d in reply.deployments}

    async def put(state: str) -> None:
        bus = await Bus.connect(own_nats, name="test")
        try:
            await bus.ensure_streams()
            record = RunRecord(run_id="run-p", recipe_toml=RECIPE, state=state)
            await (await bus.kv("runs")).put("run-p", record.to_json())
        finally:
            await bus.close()

    def wait_for(cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout}s; router log:\n{router.tail()}")
            time.sleep(0.2)

    try:
        router.wait_serving(150)
        with grpc.insecure_channel(router.address) as channel:
            stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
            assert listing(stub) == set()
            asyncio.run(put("pending"))
            wait_for(lambda: listing(stub) == {("run-p/gen", "run-p")}, 150, "run-p's deployment listed")
            asyncio.run(put("completed"))
            wait_for(lambda: listing(stub) == set(), 30, "run-p's deployment gone")
    finally:
        router.stop()
