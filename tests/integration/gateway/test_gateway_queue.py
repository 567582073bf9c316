"""The run queue of a real gateway process against a real nats-server: several runs of a tenant run at
once up to its max_concurrent_runs, the next ones are QUEUED in order (tenant priority, then age) with
their position and reason, ending a run starts the next, a queued run can be stopped, and a run that
can never fit the Ray cluster's total (which the gateway asks the inference-router for: it holds no
Ray token) is refused naming the resource."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from bench.harness.local_fleet import RouterProcess
from gateway.config import token_sha256
from gateway.queue import CLUSTER_TTL_S, ClusterState
from looprl.gateway.v1 import gateway_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.kit.rpc import tls
from tests.support.gateway import AUTH, GatewayProcess, http

Q_TOKEN, VIP_TOKEN = "token-of-team-q", "token-of-team-vip"
RECIPE = '[run]\nname = "{name}"\nsteps = 50\n[batch]\nrollouts_per_step = 4\ngroup_size = 2\n'
STARTED = (gateway_pb2.RUN_STATE_PENDING, gateway_pb2.RUN_STATE_RUNNING)


def tenant(name: str, token: str, runs: int, priority: int) -> dict:
    return {
        "name": name,
        "token_sha256": token_sha256(token),
        "max_concurrent_runs": runs,
        "max_cpus": 8,
        "max_gpus": 0,
        "priority": priority,
    }


@pytest.fixture
def gateway(nats_url: str, tmp_path: Path):
    gw = GatewayProcess(nats_url, tmp_path)
    gw.env["LOOPRL_GATEWAY_TENANTS"] = json.dumps(
        [tenant("team-q", Q_TOKEN, runs=2, priority=0), tenant("team-vip", VIP_TOKEN, runs=1, priority=5)]
    )
    gw.start()
    yield gw
    # Runs left queued on the session's nats-server would be started by the next test's gateway.
    for run in gw.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH).runs:
        if run.tenant in ("team-q", "team-vip") and run.state in (*STARTED, gateway_pb2.RUN_STATE_QUEUED):
            gw.stub.StopRun(gateway_pb2.StopRunRequest(run_id=run.run_id), metadata=AUTH)
    gw.kill()


def meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def create(gw: GatewayProcess, token: str, name: str) -> gateway_pb2.Run:
    request = gateway_pb2.CreateRunRequest(recipe_toml=RECIPE.format(name=name))
    return gw.stub.CreateRun(request, metadata=meta(token)).run


def get(gw: GatewayProcess, run_id: str) -> gateway_pb2.Run:
    return gw.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=AUTH).run


def test_runs_beyond_max_concurrent_runs_queue_by_priority_and_start_when_one_ends(
    gateway: GatewayProcess,
) -> None:
    first, second = create(gateway, Q_TOKEN, "first"), create(gateway, Q_TOKEN, "second")
    assert first.state in STARTED and second.state in STARTED
    third = create(gateway, Q_TOKEN, "third")
    assert third.state == gateway_pb2.RUN_STATE_QUEUED and third.queue_position == 1
    assert third.queued_reason == (
        "max_concurrent_runs: tenant 'team-q' has 2 active runs, its quota max_concurrent_runs=2"
    )
    # Its own slot lets the VIP's first run start; its second waits, ahead of the older third.
    assert create(gateway, VIP_TOKEN, "vip-first").state in STARTED
    vip = create(gateway, VIP_TOKEN, "vip-second")
    assert vip.state == gateway_pb2.RUN_STATE_QUEUED and vip.queue_position == 1
    assert "max_concurrent_runs=1" in vip.queued_reason
    assert get(gateway, third.run_id).queue_position == 2
    status, reply = http(gateway, f"/v1/runs/{third.run_id}")
    assert status == 200 and reply["state"] == "RUN_STATE_QUEUED"
    assert reply["queue_position"] == 2 and "max_concurrent_runs" in reply["queued_reason"]
    # A queued run is never fed: it has no driver.
    time.sleep(1.0)
    assert get(gateway, third.run_id).episodes_published == 0

    gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=first.run_id), metadata=meta(Q_TOKEN))
    now = get(gateway, third.run_id)
    assert now.state in STARTED and now.queue_position == 0 and now.queued_reason == ""
    deadline = time.monotonic() + 15
    while get(gateway, third.run_id).episodes_published == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert get(gateway, third.run_id).episodes_published > 0  # started: its driver feeds it

    stopped = gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=vip.run_id), metadata=meta(VIP_TOKEN))
    assert stopped.run.state == gateway_pb2.RUN_STATE_STOPPED and stopped.run.queue_position == 0
    time.sleep(1.0)
    assert get(gateway, vip.run_id).state == gateway_pb2.RUN_STATE_STOPPED
    assert get(gateway, vip.run_id).episodes_published == 0


def test_a_restarted_gateway_keeps_the_queue_and_starts_it_when_a_run_ends(gateway: GatewayProcess) -> None:
    running = [create(gateway, Q_TOKEN, f"before-{i}") for i in range(2)]
    waiting = create(gateway, Q_TOKEN, "waiting")
    assert waiting.state == gateway_pb2.RUN_STATE_QUEUED
    gateway.kill()
    gateway.start()
    assert get(gateway, waiting.run_id).queue_position == 1
    gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=running[0].run_id), metadata=meta(Q_TOKEN))
    assert get(gateway, waiting.run_id).state in STARTED


@pytest.fixture(scope="module")
def router(ray_head, tmp_path_factory: pytest.TempPathFactory):
    """An inference-router with no deployments of its own, joined to the session's Ray head."""
    process = RouterProcess([], tmp_path_factory.mktemp("router") / "router.log").wait_serving()
    yield process
    process.stop()


def cluster(router: RouterProcess) -> ClusterState:
    """The cluster's resources as the gateway reads them: from the router."""
    deadline = time.monotonic() + 60
    with tls.sync_channel(router.address) as channel:
        stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        while True:  # the head registers its node after a while
            try:
                reply = stub.GetClusterResources(inference_pb2.GetClusterResourcesRequest(), timeout=30)
                return ClusterState(dict(reply.total), dict(reply.in_use))
            except grpc.RpcError:
                assert time.monotonic() < deadline, (
                    f"the router never said the cluster's resources: {router.tail()}"
                )
                time.sleep(0.5)


@pytest.mark.slow
def test_a_run_over_the_clusters_total_is_refused_naming_the_resource(
    nats_url: str, tmp_path: Path, router: RouterProcess
) -> None:
    cluster(router)
    gw = GatewayProcess(nats_url, tmp_path, router_address=router.address).start()
    try:
        gpus = RECIPE + "[trainer]\nworld_size = 2\nnum_gpus_per_rank = 1.0\n"
        with pytest.raises(grpc.RpcError) as err:
            gw.stub.CreateRun(
                gateway_pb2.CreateRunRequest(recipe_toml=gpus.format(name="gpus")), metadata=AUTH
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == (
            "run: needs 2 GPU (trainer 2), more than the cluster's total GPU=0: it could never start"
        )
        cpus = RECIPE + "[trainer]\nnum_cpus_per_rank = 32.0\n"  # 32 + 1 CPUs on a 16-CPU head
        status, reply = http(gw, "/v1/runs", {"recipe_toml": cpus.format(name="cpus")})
        assert status == 429 and "the cluster's total CPU=16" in reply["error"]["message"]
    finally:
        gw.kill()


def test_a_removed_tenants_queued_run_fails_naming_the_tenant_and_its_started_runs_go_on(
    gateway: GatewayProcess,
) -> None:
    running = [create(gateway, Q_TOKEN, f"revoked-{i}") for i in range(2)]
    waiting = create(gateway, Q_TOKEN, "revoked-waiting")
    assert waiting.state == gateway_pb2.RUN_STATE_QUEUED
    gateway.kill()
    gateway.env["LOOPRL_GATEWAY_TENANTS"] = json.dumps([tenant("team-vip", VIP_TOKEN, runs=1, priority=5)])
    gateway.start()
    refused = get(gateway, waiting.run_id)
    assert refused.state == gateway_pb2.RUN_STATE_FAILED
    assert refused.error == "tenant 'team-q' is no longer configured: its queued run does not start"
    assert [get(gateway, r.run_id).state in STARTED for r in running] == [True, True]
    # The removed tenant's token no longer opens anything.
    with pytest.raises(grpc.RpcError) as err:
        create(gateway, Q_TOKEN, "after-removal")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_workers_no_run_asked_for_take_their_share_and_a_queued_run_starts_when_they_go(
    nats_url: str, tmp_path: Path, router: RouterProcess, ray_client
) -> None:
    import ray

    class Worker:  # stands for a service's own workers (a sandbox fleet, reward-model replicas)
        def ping(self) -> bool:
            return True

    before = cluster(router)
    free = before.total["CPU"] - before.in_use.get("CPU", 0.0)
    workers = ray.remote(num_cpus=free - 1.0)(Worker).remote()  # all the CPUs but one
    ray.get(workers.ping.remote())
    gw = GatewayProcess(nats_url, tmp_path, router_address=router.address).start()
    run_id = ""
    try:
        deadline = time.monotonic() + 30
        while cluster(router).in_use.get("CPU", 0.0) < before.total["CPU"] - 1.0 - 1e-6:
            assert time.monotonic() < deadline, "Ray never counted the workers' CPUs as in use"
            time.sleep(0.2)
        time.sleep(CLUSTER_TTL_S)  # the gateway's last read is from before the workers
        five_cpus = RECIPE + "[trainer]\nnum_cpus_per_rank = 2.0\n"  # 2 ranks x 2 CPUs + 1 replica
        run = gw.stub.CreateRun(
            gateway_pb2.CreateRunRequest(recipe_toml=five_cpus.format(name="behind-workers")), metadata=AUTH
        ).run
        run_id = run.run_id
        assert run.state == gateway_pb2.RUN_STATE_QUEUED
        assert run.queued_reason.startswith("cluster CPU: needs 5, "), run.queued_reason
        ray.kill(workers)
        deadline = time.monotonic() + 60
        while get(gw, run_id).state not in STARTED:
            assert time.monotonic() < deadline, (
                f"the run did not start after the workers went: {get(gw, run_id)}"
            )
            time.sleep(0.5)
    finally:
        ray.kill(workers)
        if run_id:
            gw.stub.StopRun(gateway_pb2.StopRunRequest(run_id=run_id), metadata=AUTH)
        gw.kill()
        # The session's head is shared: later tests' actors need these CPUs back.
        deadline = time.monotonic() + 30
        while cluster(router).in_use.get("CPU", 0.0) > before.in_use.get("CPU", 0.0) + 1e-6:
            assert time.monotonic() < deadline, "the workers' CPUs were not given back"
            time.sleep(0.2)
