"""The OpenAI-compatible endpoint without `model`: a request goes to the caller's one active run (a
400 naming `model` when it may reach several), never to another tenant's, and its reply names the
run or deployment that served it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from gateway.auth import TokenAuth
from gateway.http import HttpApi
from gateway.servicer import RunManager
from looprl.inference.v1 import inference_pb2
from services.kit.config.recipe import RunRecord
from services.modeling.tokenizer import TokenizerCache
from tests.unit.gateway.test_openai_runs import team
from tests.unit.gateway.test_queue import MemoryStore


class RunRouter:
    """A router whose deployments are all runs' own (a stack started without a recipe). It routes
    as the real one does (services/inference_router/run_scope.py): a request of a run to that run's
    deployments, one without a run to the stack's, or to any deployment when the stack has none."""

    def __init__(self, runs: list[str]) -> None:
        self.runs = runs
        self.requests: list[inference_pb2.GenerateRequest] = []

    async def ListDeployments(self, request, timeout=None):
        return inference_pb2.ListDeploymentsResponse(
            deployments=[inference_pb2.DeploymentInfo(name=f"{r}/default", run_id=r) for r in self.runs],
            starts_run_deployments=True,
        )

    async def Generate(self, request, timeout=None):
        self.requests.append(request)
        served = f"{request.run_id}/default" if request.run_id else f"{self.runs[0]}/default"
        completion = inference_pb2.Completion(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length")
        return inference_pb2.GenerateResponse(completions=[completion], deployment=served)


def chat(runs: list[tuple[str, str, str]], bodies: list[tuple[str, dict]]) -> tuple[list, RunRouter]:
    """Each (tenant, body) posted to /v1/chat/completions of a gateway whose store holds `runs`
    (run id, tenant, state), oldest first: [(status, reply)], and the router the replies came from."""
    store = MemoryStore()
    for i, (run_id, owner, state) in enumerate(runs):
        store.records[run_id] = RunRecord(run_id, "", state=state, created_at=float(i), tenant=owner)
    router = RunRouter([r for r, _, state in runs if state == "running"])
    tenants = [team("team-a"), team("team-b"), team("ops", admin=True)]
    auth = TokenAuth([], tenants=[(t.token_sha256, t) for t in tenants])
    app = HttpApi(RunManager(None, store, Path(".")), auth, router, TokenizerCache()).app()  # type: ignore[arg-type]

    async def drive() -> list:
        out = []
        async with TestClient(TestServer(app)) as client:
            for tenant, body in bodies:
                body = {"messages": [{"role": "user", "content": "12"}], "max_tokens": 2, **body}
                reply = await client.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {tenant}"}
                )
                out.append((reply.status, await reply.json()))
        return out

    return asyncio.run(drive()), router


def test_without_model_the_reply_comes_from_and_names_the_callers_own_run() -> None:
    # Tenant b's newest run is served by its own deployment, never by tenant a's (the router takes
    # any deployment for a request that names no run), and the reply says which run served it.
    replies, router = chat(
        [("run-a", "team-a", "running"), ("run-b", "team-b", "running")],
        [("team-b", {}), ("team-a", {})],
    )
    assert [status for status, _ in replies] == [200, 200], replies
    assert [r.run_id for r in router.requests] == ["run-b", "run-a"]
    assert [reply["model"] for _, reply in replies] == ["run-b", "run-a"]


def test_without_model_a_caller_reaching_several_active_runs_must_name_one() -> None:
    runs = [("run-a1", "team-a", "running"), ("run-b", "team-b", "running"), ("run-a2", "team-a", "running")]
    replies, router = chat(
        runs, [("team-a", {}), ("ops", {}), ("team-b", {}), ("team-a", {"model": "run-a1"})]
    )
    (status_a, reply_a), (status_ops, reply_ops), (status_b, _), (status_named, named) = replies
    assert (status_a, reply_a["error"]["param"]) == (400, "model")
    assert reply_a["error"]["message"].startswith("model: required: 2 runs you may sample from are active")
    assert "run-a1" in reply_a["error"]["message"] and "run-b" not in reply_a["error"]["message"]
    assert (status_ops, reply_ops["error"]["param"]) == (400, "model")  # an admin reaches all three
    assert status_b == 200 and status_named == 200 and named["model"] == "run-a1"
    assert [r.run_id for r in router.requests] == ["run-b", "run-a1"]


def test_another_tenants_run_is_never_reached_with_or_without_model() -> None:
    replies, router = chat(
        [("run-a", "team-a", "running"), ("run-b", "team-b", "completed")],
        [("team-b", {}), ("team-b", {"model": "run-a"}), ("team-b", {"model": "run-a/default"})],
    )
    for status, reply in replies:
        assert (status, reply["error"]["code"], reply["error"]["param"]) == (404, "model_not_found", "model")
    assert router.requests == []
