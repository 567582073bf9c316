"""The OpenAI-compatible endpoint with several runs on one stack: `model=<run id>` asks the router for
that run's own deployments, a run's own deployment is listed only to tenants that may see the run,
and the stack's deployments as before (without `model`: test_openai_default_model.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config import Tenant, token_sha256
from gateway.openai_api import OpenAIEndpoints, OpenAIError, Target
from gateway.servicer import RunManager
from looprl.inference.v1 import inference_pb2
from services.kit.config.recipe import RunRecord
from services.modeling.tokenizer import TokenizerCache
from tests.unit.gateway.test_queue import MemoryStore


def team(name: str, admin: bool = False) -> Tenant:
    return Tenant(
        name=name,
        token_sha256=token_sha256(name),
        admin=admin,
        max_concurrent_runs=5,
        max_cpus=64,
        max_gpus=0,
    )


class Router:
    async def ListDeployments(self, request, timeout=None):
        return inference_pb2.ListDeploymentsResponse(
            deployments=[
                inference_pb2.DeploymentInfo(name="default"),  # the stack's
                inference_pb2.DeploymentInfo(name="run-a/default", run_id="run-a"),
                inference_pb2.DeploymentInfo(name="run-b/default", run_id="run-b"),
            ]
        )


def endpoints() -> OpenAIEndpoints:
    store = MemoryStore()
    for i, (run_id, owner) in enumerate([("run-a", "team-a"), ("run-b", "team-b")]):
        store.records[run_id] = RunRecord(run_id, "", state="running", created_at=float(i), tenant=owner)
    runs = RunManager(None, store, Path("."))  # type: ignore[arg-type]
    return OpenAIEndpoints(runs, Router(), TokenizerCache())  # type: ignore[arg-type]


def test_a_tenant_sees_its_runs_own_deployments_and_the_stacks_only_while_it_serves_its_run() -> None:
    api = endpoints()

    async def check() -> None:
        _, usable_a, _ = await api._policies(team("team-a"))
        assert set(usable_a) == {"run-a/default"}  # the stack's deployment serves run-b, the newest
        _, usable_b, _ = await api._policies(team("team-b"))
        assert set(usable_b) == {"default", "run-b/default"}
        _, usable_admin, _ = await api._policies(team("ops", admin=True))
        assert set(usable_admin) == {"default", "run-a/default", "run-b/default"}

    asyncio.run(check())


def test_model_set_to_a_run_or_its_deployment_asks_the_router_for_that_runs_deployments() -> None:
    api = endpoints()

    async def check() -> None:
        target = await api._resolve({"model": "run-a"}, team("team-a"))
        assert (target.label, target.deployment, target.run_id) == ("run-a", "", "run-a")
        target = await api._resolve({"model": "run-a/default"}, team("team-a"))
        assert (target.deployment, target.run_id) == ("run-a/default", "run-a")
        target = await api._resolve({"model": "default"}, team("team-b"))
        assert (target.deployment, target.run_id) == ("default", "")  # the stack's serves any run
        request = api._request({}, [1, 2], Target("run-a", target.tokenizer, "", "run-a"), team("team-a"))
        assert request.run_id == "run-a" and request.deployment == ""
        for model in ("run-b", "run-b/default"):
            with pytest.raises(OpenAIError) as err:
                await api._resolve({"model": model}, team("team-a"))
            assert err.value.code == "model_not_found"

    asyncio.run(check())
