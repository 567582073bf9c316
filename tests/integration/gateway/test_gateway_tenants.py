"""Tenancy of a real gateway process against a real nats-server: two tenants and an admin.

A tenant gets, watches, stops, lists and samples only its own runs: another tenant's run answers
NOT_FOUND (HTTP 404), word for word as a run that does not exist; an admin sees every run. A wrong
token is UNAUTHENTICATED (401). A run over the tenant's GPU quota is RESOURCE_EXHAUSTED (429) naming
the resource, and creates nothing; one beyond its concurrent runs waits QUEUED until one ends.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from gateway.config import token_sha256
from looprl.gateway.v1 import gateway_pb2
from tests.support.gateway import AUTH, GatewayProcess, openai_error

A_TOKEN, B_TOKEN = "token-of-team-a", "token-of-team-b"
RECIPE = '[run]\nname = "{name}"\nsteps = 50\n[batch]\nrollouts_per_step = 4\ngroup_size = 2\n'
GPU_RECIPE = RECIPE + "[trainer]\nworld_size = 2\nnum_gpus_per_rank = 1.0\n"


def tenant(name: str, token: str, runs: int, gpus: float) -> dict:
    return {
        "name": name,
        "token_sha256": token_sha256(token),
        "max_concurrent_runs": runs,
        "max_cpus": 8,
        "max_gpus": gpus,
    }


@pytest.fixture
def gateway(nats_url: str, tmp_path: Path):
    gw = GatewayProcess(nats_url, tmp_path)
    gw.env["LOOPRL_GATEWAY_TENANTS"] = json.dumps(
        [tenant("team-a", A_TOKEN, runs=1, gpus=1), tenant("team-b", B_TOKEN, runs=2, gpus=0)]
    )
    gw.start()  # as the admin of LOOPRL_GATEWAY_TOKENS
    yield gw
    gw.kill()


def meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def http(gw: GatewayProcess, token: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}{path}", data=data)
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            text = reply.read().decode()
            return reply.status, json.loads(text) if not text.startswith("data:") else text
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grpc_code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        reply = call(*args, **kwargs)
        if hasattr(reply, "__iter__") and not hasattr(reply, "DESCRIPTOR"):
            list(reply)
    return err.value.code(), err.value.details()


def create(gw: GatewayProcess, token: str, name: str, recipe: str = RECIPE) -> str:
    request = gateway_pb2.CreateRunRequest(recipe_toml=recipe.format(name=name))
    return gw.stub.CreateRun(request, metadata=meta(token)).run.run_id


def all_runs(gw: GatewayProcess) -> dict[str, gateway_pb2.Run]:
    return {r.run_id: r for r in gw.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH).runs}


def test_a_tenant_cannot_see_watch_stop_list_or_sample_another_tenants_run(gateway: GatewayProcess) -> None:
    run_a, run_b = create(gateway, A_TOKEN, "a"), create(gateway, B_TOKEN, "b")
    stub = gateway.stub
    # gRPC: B's run is NOT_FOUND for A, in the words a run that does not exist gets.
    missing = grpc_code(stub.GetRun, gateway_pb2.GetRunRequest(run_id="no-such-run"), metadata=meta(A_TOKEN))
    assert missing == (grpc.StatusCode.NOT_FOUND, "run_id: no run 'no-such-run'")
    for call, request in (
        (stub.GetRun, gateway_pb2.GetRunRequest(run_id=run_b)),
        (stub.WatchRun, gateway_pb2.WatchRunRequest(run_id=run_b)),
        (stub.StopRun, gateway_pb2.StopRunRequest(run_id=run_b)),
    ):
        assert grpc_code(call, request, metadata=meta(A_TOKEN)) == (
            grpc.StatusCode.NOT_FOUND,
            f"run_id: no run {run_b!r}",
        )
    listed = stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=meta(A_TOKEN)).runs
    assert [(r.run_id, r.tenant) for r in listed] == [(run_a, "team-a")]
    assert stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_a), metadata=meta(A_TOKEN)).run.run_id == run_a

    # HTTP: the same, as 404s.
    for method_path, body in (
        (f"/v1/runs/{run_b}", None),
        (f"/v1/runs/{run_b}/watch", None),
        (f"/v1/runs/{run_b}/stop", {}),
    ):
        status, reply = http(gateway, A_TOKEN, method_path, body)
        assert (status, openai_error(reply)["code"]) == (404, "NOT_FOUND"), (method_path, reply)
        assert openai_error(reply)["message"] == f"run_id: no run {run_b!r}"
    status, reply = http(gateway, A_TOKEN, "/v1/runs")
    assert status == 200 and [r["run_id"] for r in reply["runs"]] == [run_a]

    # Sampling: B's run is an unknown model for A; A's own run is a model A may use.
    status, models = http(gateway, A_TOKEN, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [run_a]
    status, reply = http(gateway, A_TOKEN, f"/v1/models/{run_b}")
    assert status == 404 and openai_error(reply)["code"] == "model_not_found"
    for route, body in (
        ("/v1/completions", {"model": run_b, "prompt": "12"}),
        ("/v1/chat/completions", {"model": run_b, "messages": [{"role": "user", "content": "12"}]}),
    ):
        status, reply = http(gateway, A_TOKEN, route, body)
        assert (status, openai_error(reply)["code"]) == (404, "model_not_found"), (route, reply)
    # A's own run gets past the model check (this gateway has no inference-router to sample with).
    status, reply = http(gateway, A_TOKEN, "/v1/completions", {"model": run_a, "prompt": "12"})
    assert status == 503 and "inference-router" in openai_error(reply)["message"], reply

    # B's run is untouched by A's attempts; the admin sees both, with their tenants.
    runs = all_runs(gateway)
    assert (runs[run_a].tenant, runs[run_b].tenant) == ("team-a", "team-b")
    assert runs[run_b].state in (gateway_pb2.RUN_STATE_PENDING, gateway_pb2.RUN_STATE_RUNNING)
    status, reply = http(gateway, "s3cret-token", f"/v1/runs/{run_b}")
    assert status == 200 and reply["tenant"] == "team-b"
    status, models = http(gateway, "s3cret-token", "/v1/models")
    assert {run_a, run_b} <= {m["id"] for m in models["data"]}
    # Each stops its own run.
    for run_id, token in ((run_b, B_TOKEN), (run_a, A_TOKEN)):
        stopped = stub.StopRun(gateway_pb2.StopRunRequest(run_id=run_id), metadata=meta(token)).run
        assert stopped.state == gateway_pb2.RUN_STATE_STOPPED


def test_a_wrong_token_is_unauthenticated(gateway: GatewayProcess) -> None:
    for token in ("not-a-token", token_sha256(A_TOKEN)):  # the configured hash is not a token
        code, _ = grpc_code(
            stub_list := gateway.stub.ListRuns, gateway_pb2.ListRunsRequest(), metadata=meta(token)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED, stub_list
        status, reply = http(gateway, token, "/v1/runs")
        assert (status, openai_error(reply)["type"]) == (401, "authentication_error")


def test_a_run_over_the_quota_is_refused_and_one_beyond_the_concurrent_runs_queues(
    gateway: GatewayProcess,
) -> None:
    # The nats-server is the session's: runs of other tests are on it. None of team-a's is active.
    for run in all_runs(gateway).values():
        if run.tenant == "team-a" and run.state in (
            gateway_pb2.RUN_STATE_QUEUED,
            gateway_pb2.RUN_STATE_PENDING,
            gateway_pb2.RUN_STATE_RUNNING,
        ):
            gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=run.run_id), metadata=AUTH)
    before = set(all_runs(gateway))
    code, message = grpc_code(
        gateway.stub.CreateRun,
        gateway_pb2.CreateRunRequest(recipe_toml=GPU_RECIPE.format(name="big")),
        metadata=meta(A_TOKEN),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        message
        == "trainer: 2 GPUs (world_size 2 x num_gpus_per_rank 1.0) exceed tenant 'team-a' quota max_gpus=1"
    )
    status, reply = http(gateway, A_TOKEN, "/v1/runs", {"recipe_toml": GPU_RECIPE.format(name="big")})
    assert status == 429 and "quota max_gpus=1" in openai_error(reply)["message"]
    assert set(all_runs(gateway)) == before

    first = create(gateway, A_TOKEN, "first")
    second = gateway.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=RECIPE.format(name="second")), metadata=meta(A_TOKEN)
    ).run
    assert second.state == gateway_pb2.RUN_STATE_QUEUED and "max_concurrent_runs=1" in second.queued_reason
    status, reply = http(gateway, A_TOKEN, "/v1/runs", {"recipe_toml": RECIPE.format(name="third")})
    assert status == 201 and reply["state"] == "RUN_STATE_QUEUED" and reply["queue_position"] == 2
    assert set(all_runs(gateway)) == before | {first, second.run_id, reply["run_id"]}
    # Another tenant's quota is its own; and a stopped run frees A's slot for its next queued run.
    b = create(gateway, B_TOKEN, "b")
    assert all_runs(gateway)[b].state != gateway_pb2.RUN_STATE_QUEUED
    gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=first), metadata=meta(A_TOKEN))
    assert all_runs(gateway)[second.run_id].state in (
        gateway_pb2.RUN_STATE_PENDING,
        gateway_pb2.RUN_STATE_RUNNING,
    )
    for run_id in (second.run_id, reply["run_id"]):
        gateway.stub.StopRun(gateway_pb2.StopRunRequest(run_id=run_id), metadata=meta(A_TOKEN))
