"""The router with the real weight-sync service: replicas get their weights only through weight-sync
(the router registers every replica as a target), a request demanding a version waits for it, and a
killed replica comes back on a new address, is registered again, receives the latest version and
only then serves again — nothing in the test loads weights by hand."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from bench.harness.local_fleet import RouterProcess, replica_actor, tiny_checkpoint
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.local.infra import free_port
from tests.support.weight_sync_process import weight_sync_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def weight_sync(tmp_path_factory):
    with weight_sync_process(tmp_path_factory.mktemp("ws")) as (address, _):
        yield address


def _push(stub, state, config, version):
    from bench.harness.synthetic_weights import rank_requests

    config_json = json.dumps(config.to_hf_dict())
    for rank in range(2):
        stub.PushShards(
            iter(
                list(rank_requests(state, version=version, rank=rank, world=2, model_config_json=config_json))
            ),
            timeout=60,
        )


def _listing(stub):
    reply = stub.ListDeployments(inference_pb2.ListDeploymentsRequest(), timeout=5)
    return {r.name: (r.healthy, r.weight_version) for d in reply.deployments for r in d.replicas}


def _wait(cond, timeout, router, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout}s; router log:\n{router.tail()}")


def test_replicas_receive_weights_through_weight_sync_and_a_restarted_one_resyncs(
    ray_client, weight_sync, tmp_path
):
    import ray

    deployments = [{"name": "d", "num_cpus": 0.5, "replicas": 2, "max_model_len": 128, "max_batch_size": 8}]
    router = RouterProcess(
        deployments,
        tmp_path / "router.log",
        weight_sync_address=weight_sync,
        status_interval_s=0.2,
        version_wait_s=30,
    )
    ws_channel = grpc.insecure_channel(weight_sync)
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(ws_channel)
    try:
        router.wait_serving(150)
        channel = grpc.insecure_channel(router.address)
        stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        targets = {t.deployment for t in ws.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=5).targets}
        assert targets == {"d-r0", "d-r1"}

        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[4, 5, 6],
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=1.0),
            min_weight_version=1,
        )
        waiting = stub.Generate.future(request, timeout=60)  # no replica has weights yet: it waits
        config, state = tiny_checkpoint(seed=1)
        _push(ws, state, config, version=1)
        response = waiting.result()
        assert response.completions[0].weight_version == 1
        _wait(
            lambda: _listing(stub) == {"d-r0": (True, 1), "d-r1": (True, 1)},
            30,
            router,
            "both replicas at v1",
        )

        ray.kill(replica_actor("d", 0, router.namespace), no_restart=False)
        # While d-r0 restarts and resyncs every request is still served, and only ever with v1: the
        # restarted replica is out of routing until it holds the latest version again. (Which
        # replica answers depends on how fast Ray restarts d-r0; a clean-clone run saw d-r0 already
        # back at v1 for the first request.)
        for _ in range(3):
            reply = stub.Generate(request, timeout=60)
            assert reply.replica in ("d-r0", "d-r1") and reply.completions[0].weight_version == 1
        _wait(lambda: _listing(stub)["d-r0"] == (True, 1), 60, router, "restarted replica resynced to v1")
        served = {stub.Generate(request, timeout=60).replica for _ in range(6)}
        assert served == {"d-r0", "d-r1"}
        channel.close()
    except BaseException:
        print("router log:\n" + router.tail(12000))  # shown by pytest on failure
        raise
    finally:
        router.stop()
        ws_channel.close()


def test_a_replica_started_before_weight_sync_answers_is_registered_once_it_does(ray_client, tmp_path):
    """weight-sync starting late (or restarting) when a deployment comes up: the registration the
    router could not make is made as soon as weight-sync answers, not lost for the run."""
    port = free_port()
    deployments = [
        {"name": "early", "num_cpus": 0.5, "replicas": 1, "max_model_len": 128, "max_batch_size": 8}
    ]
    router = RouterProcess(
        deployments, tmp_path / "router.log", weight_sync_address=f"127.0.0.1:{port}", status_interval_s=0.2
    )
    try:
        router.wait_serving(150)
        assert "registration of early-r0 failed, trying again" in router.tail()
        with weight_sync_process(tmp_path, port=port) as (address, _):
            ws = weightsync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(address))
            _wait(
                lambda: (
                    {
                        t.deployment
                        for t in ws.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=5).targets
                    }
                    == {"early-r0"}
                ),
                30,
                router,
                "early-r0 was not registered with the late weight-sync",
            )
    finally:
        router.stop()
