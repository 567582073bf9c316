"""The run manager over an in-memory run store: what a tenant's calls reveal of other tenants' runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config import Tenant, token_sha256
from gateway.servicer import RunManager
from services.kit.config.recipe import RunRecord
from services.kit.rpc.errors import FailedPrecondition, NotFound


class MemoryStore:
    def __init__(self, records: list[RunRecord]) -> None:
        self.records = {r.run_id: r for r in records}

    async def list(self) -> list[RunRecord]:
        return sorted(self.records.values(), key=lambda r: r.created_at)

    async def get(self, run_id: str) -> RunRecord | None:
        return self.records.get(run_id)


def tenant(name: str, admin: bool = False) -> Tenant:
    return Tenant(
        name=name,
        token_sha256=token_sha256(name),
        admin=admin,
        max_concurrent_runs=5,
        max_cpus=64,
        max_gpus=0,
    )


RUNS = [
    RunRecord("run-a", "", state="running", created_at=1.0, tenant="team-a"),
    RunRecord("run-b", "", state="completed", created_at=2.0, tenant="team-b"),
    RunRecord("old-run", "", state="completed", created_at=0.5),  # created before tenants: no owner
]


def manager() -> RunManager:
    return RunManager(None, MemoryStore(RUNS), Path("."))  # type: ignore[arg-type]


def test_a_tenant_lists_and_gets_only_its_runs_and_an_admin_every_run() -> None:
    runs = manager()

    async def check() -> None:
        assert [r.run_id for r in await runs.list(tenant("team-a"))] == ["run-a"]
        assert [r.run_id for r in await runs.list(tenant("ops", admin=True))] == ["old-run", "run-a", "run-b"]
        assert (await runs.get("run-b", tenant("team-b"))).tenant == "team-b"
        for run_id in ("run-b", "old-run", "nothing"):
            with pytest.raises(NotFound) as err:
                await runs.get(run_id, tenant("team-a"))
            assert err.value.message == f"run_id: no run {run_id!r}"

    asyncio.run(check())


def test_a_router_serving_fixed_deployments_takes_one_run_and_names_it_only_to_its_tenant() -> None:
    # Its deployments hold the first run's weights: a second run would sample that policy.
    runs = manager()

    async def refused(caller: Tenant) -> str:
        with pytest.raises(FailedPrecondition) as err:
            await runs._refuse_sharing(caller)
        return err.value.message

    assert "served run 'run-b' (completed); one run per such stack" in asyncio.run(refused(tenant("team-b")))
    assert "served another tenant's run;" in asyncio.run(refused(tenant("team-a")))
    empty = RunManager(None, MemoryStore([]), Path("."))  # type: ignore[arg-type]
    asyncio.run(empty._refuse_sharing(tenant("team-a")))  # the first run is served
