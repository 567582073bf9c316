"""The inference-router as a real process on the session's Ray head, with real replicas of a tiny
Qwen2 in two deployments (tp=1 x2 for short outputs, tp=2 x1 for long outputs).

One router process serves the whole module (starting replicas is the expensive part); tests run in
file order and the replica-kill test comes last.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bench.harness.local_fleet import RouterProcess, load_weights, replica_actor, tiny_checkpoint
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEPLOYMENTS = [
    {
        "name": "short",
        "num_cpus": 0.5,
        "replicas": 2,
        "tensor_parallel": 1,
        "max_output_tokens": 16,
        "max_model_len": 128,
        "max_batch_size": 8,
    },
    {
        "name": "long",
        "num_cpus": 0.5,
        "replicas": 1,
        "tensor_parallel": 2,
        "min_output_tokens": 17,
        "max_model_len": 256,
        "max_batch_size": 8,
    },
]
VERSION_WAIT_S = 1.5


@pytest.fixture(scope="module")
def fleet(ray_client, tmp_path_factory):
    import ray

    router = RouterProcess(
        DEPLOYMENTS,
        tmp_path_factory.mktemp("router") / "router.log",
        version_wait_s=VERSION_WAIT_S,
        version_unavailable_code="UNAVAILABLE",
        status_interval_s=0.2,
    )
    try:
        router.wait_serving(timeout=150)
        config, weights = tiny_checkpoint(seed=0)
        actors = {
            f"{d['name']}-r{i}": replica_actor(d["name"], i, router.namespace)
            for d in DEPLOYMENTS
            for i in range(d["replicas"])
        }
        ray.get([load_weights(a, config, weights, 1) for a in actors.values()], timeout=120)
        channel = grpc.insecure_channel(router.address)
        stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        _wait_for(lambda: _versions(stub) == {name: 1 for name in actors}, 30, router)
        yield router, stub, actors, (config, weights)
        channel.close()
    finally:
        router.stop()


def _versions(stub) -> dict[str, int]:
    listing = stub.ListDeployments(inference_pb2.ListDeploymentsRequest(), timeout=5)
    return {r.name: (r.weight_version if r.healthy else -99) for d in listing.deployments for r in d.replicas}


def _wait_for(cond, timeout, router):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout}s; router log:\n{router.tail()}")


def _req(max_tokens=8, prompt=(5, 6, 7, 8), **kw):
    return inference_pb2.GenerateRequest(
        prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=3),
        **kw,
    )


def test_requests_land_on_the_deployment_whose_profile_fits(fleet):
    _, stub, _, _ = fleet
    short = stub.Generate(_req(max_tokens=8), timeout=60)
    long = stub.Generate(_req(max_tokens=40), timeout=60)
    assert short.deployment == "short" and long.deployment == "long"
    for response, n_tokens in ((short, 8), (long, 40)):
        (completion,) = response.completions
        assert 0 < len(completion.token_ids) <= n_tokens
        assert len(completion.logprobs) == len(completion.token_ids)
        assert completion.weight_version == 1
    # A short request that expects a long answer goes by its hint.
    hinted = stub.Generate(_req(max_tokens=20, expected_output_tokens=10), timeout=60)
    assert hinted.deployment == "short"
    chunks = list(
        stub.GenerateStream(inference_pb2.GenerateStreamRequest(request=_req(max_tokens=24)), timeout=60)
    )
    assert {c.deployment for c in chunks} == {"long"}
    assert chunks[-1].finish_reason in ("stop", "length")
    assert 0 < sum(len(c.token_ids) for c in chunks) <= 24


def test_a_session_sticks_to_its_replica(fleet):
    _, stub, _, _ = fleet
    prompt = [5, 6, 7]
    replicas = set()
    for _turn in range(4):
        response = stub.Generate(_req(max_tokens=4, prompt=prompt, session_id="episode-1"), timeout=60)
        replicas.add((response.deployment, response.replica))
        prompt = prompt + list(response.completions[0].token_ids) + [9]
    assert len(replicas) == 1
    # Another session is free to land elsewhere; load-balancing spreads sessions over both replicas.
    spread = {stub.Generate(_req(max_tokens=2, session_id=f"s{i}"), timeout=60).replica for i in range(6)}
    assert spread == {"short-r0", "short-r1"}


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"prompt": ()}, "prompt_token_ids"),
        ({"deployment": "nope"}, "deployment"),
        ({"max_tokens": 1000}, "sampling.max_tokens"),
        ({"prompt": (1, 10_000)}, "prompt_token_ids"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field_and_the_server_keeps_serving(fleet, kw, field):
    _, stub, _, _ = fleet
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req(**kw), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details(), err.value.details()
    assert stub.Generate(_req(max_tokens=2), timeout=60).completions


def test_negative_temperature_is_invalid_argument(fleet):
    _, stub, _, _ = fleet
    bad = _req()
    bad.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature" in err.value.details()


def test_min_weight_version_waits_for_the_version_or_fails_clearly(fleet):
    import ray

    _router, stub, actors, (config, weights) = fleet
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req(min_weight_version=9), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "min_weight_version" in err.value.details() and "9" in err.value.details()
    assert time.monotonic() - start >= VERSION_WAIT_S * 0.9

    # Version 2 appears on one replica while the request waits: it is served there.
    future = stub.Generate.future(_req(min_weight_version=2), timeout=30)
    time.sleep(0.3)
    ray.get(load_weights(actors["short-r0"], config, weights, 2), timeout=60)
    response = future.result()
    assert response.replica == "short-r0" and response.completions[0].weight_version == 2


def test_killing_a_replica_mid_load_loses_no_request(fleet):
    import ray

    router, stub, actors, (config, weights) = fleet

    async def load() -> list[inference_pb2.GenerateResponse]:
        """12 clients send requests back to back for 2.5 s (and at least 2 each, however slow the
        machine); the replica dies at 0.8 s."""
        channel = grpc.aio.insecure_channel(router.address)
        aio_stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 2.5
        done: list[inference_pb2.GenerateResponse] = []

        async def client(i: int) -> None:
            sent = 0
            while loop.time() < stop_at or sent < 2:
                sent += 1
                done.append(await aio_stub.Generate(_req(max_tokens=16, prompt=(3, 4, i + 1)), timeout=120))

        async def killer() -> None:
            await asyncio.sleep(0.8)
            ray.kill(actors["short-r0"], no_restart=False)  # Ray restarts it, without weights

        try:
            await asyncio.gather(killer(), *(client(i) for i in range(12)))
        finally:
            await channel.close()
        return done

    retried_before = router.metric("looprl_router_retries_total", deployment="short", replica="short-r0")
    responses = asyncio.run(load())
    assert len(responses) >= 24  # every client request returned (gather would raise otherwise)
    assert all(len(r.completions[0].token_ids) > 0 for r in responses)
    # Requests were in flight on the killed replica and were retried elsewhere.
    assert (
        router.metric("looprl_router_retries_total", deployment="short", replica="short-r0") > retried_before
    )
    # The restarted replica stays out of routing until it has the newest version (2) again.
    _wait_for(lambda: _versions(stub)["short-r0"] == -99, 30, router)
    served = {stub.Generate(_req(max_tokens=2), timeout=60).replica for _ in range(4)}
    assert served == {"short-r1"}
    restarted = replica_actor("short", 0, router.namespace)
    deadline = time.monotonic() + 60
    while True:  # the actor may still be restarting: Ray answers ActorUnavailableError meanwhile
        try:
            ray.get(load_weights(restarted, config, weights, 2), timeout=60)
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, router.tail()
            time.sleep(0.5)
    _wait_for(lambda: _versions(stub)["short-r0"] == 2, 30, router)
