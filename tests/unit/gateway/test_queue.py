"""The run queue and the admission decision: a run that fits starts, one that fits but not now waits
in order (tenant priority, then age) naming what it waits for, one that can never fit is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gateway.admission import run_demand
from gateway.config import Tenant, token_sha256
from gateway.progress import progress_line
from gateway.queue import ClusterResources, ClusterState, Waiting, plan, queue_order
from gateway.runs import RunDriver
from gateway.servicer import STATIC_DEPLOYMENTS_KEY, RunManager
from looprl.gateway.v1 import gateway_pb2
from services.kit.config.recipe import RunRecord
from services.kit.rpc.errors import ResourceExhausted, Unavailable

RECIPE = '[run]\nname = "{name}"\n'  # the default run: 2 CPUs (trainer 1, one replica 1)
BIG = RECIPE + "[trainer]\nworld_size = 8\n"  # 4 + 1 CPUs


def team(name: str, runs: int = 5, priority: int = 0) -> Tenant:
    return Tenant(
        name=name,
        token_sha256=token_sha256(name),
        max_concurrent_runs=runs,
        max_cpus=64,
        max_gpus=0,
        priority=priority,
    )


def queued(run_id: str, created_at: float, tenant: Tenant, recipe: str = RECIPE) -> Waiting:
    record = RunRecord(
        run_id, recipe.format(name=run_id), state="queued", created_at=created_at, tenant=tenant.name
    )
    return Waiting(record, tenant, run_demand(record.recipe()))


def demand_of(record: RunRecord):
    return run_demand(record.recipe())


def test_the_queue_puts_higher_priority_tenants_first_then_the_oldest() -> None:
    low, high = team("low", priority=0), team("high", priority=5)
    waiting = [queued("low-old", 1.0, low), queued("high-new", 3.0, high), queued("low-new", 2.0, low)]
    assert [w.record.run_id for w in queue_order(waiting)] == ["high-new", "low-old", "low-new"]


def test_a_run_waits_for_its_tenants_concurrency_and_for_free_cluster_resources() -> None:
    a, b = team("a", runs=1), team("b", runs=5)
    running = RunRecord("a-1", RECIPE.format(name="a-1"), state="running", created_at=0.0, tenant="a")
    waiting = [queued("a-2", 1.0, a), queued("b-1", 2.0, b), queued("b-2", 3.0, b)]
    decided = {w.record.run_id: reason for w, reason in plan(waiting, [running], demand_of, {"CPU": 5})}
    assert (
        decided["a-2"] == "max_concurrent_runs: tenant 'a' has 1 active runs, its quota max_concurrent_runs=1"
    )
    assert decided["b-1"] == ""  # 2 of the 5 CPUs are the running run's: 3 free, then 1
    assert decided["b-2"] == "cluster CPU: needs 2, 1 of 5 free"
    # Without a cluster to read only the quotas apply.
    unread = {w.record.run_id: reason for w, reason in plan(waiting, [running], demand_of, None)}
    assert unread == {"a-2": decided["a-2"], "b-1": "", "b-2": ""}


def test_what_ray_holds_beyond_the_started_runs_demand_is_not_free() -> None:
    a = team("a", runs=5)
    running = RunRecord("a-1", RECIPE.format(name="a-1"), state="running", created_at=0.0, tenant="a")
    waiting = [queued("a-2", 1.0, a)]

    def reason(in_use: dict[str, float]) -> str:
        return plan(waiting, [running], demand_of, {"CPU": 5}, in_use)[0][1]

    # Ray counts less than the running run asks (its actors are still being created): its demand holds.
    assert reason({"CPU": 0.5}) == ""
    # Workers no run asked for (a service's sandbox fleet, reward-model replicas) hold 2 CPUs more.
    assert reason({"CPU": 4.0}) == "cluster CPU: needs 2, 1 of 5 free"


def test_a_run_on_the_routers_configured_deployments_asks_only_for_its_trainer() -> None:
    # Those replicas are placed before any run: Ray counts them in use, the run must not ask again.
    runs, _ = manager([], {"CPU": 2})
    record = RunRecord("s", RECIPE.format(name="s"), state="queued", created_at=0.0, tenant="a")
    record.extra[STATIC_DEPLOYMENTS_KEY] = True
    demand = runs._demand(record)
    assert demand.resources() == {"CPU": 1.0} and [p.name for p in demand.parts] == ["trainer"]
    waiting = [Waiting(record, team("a"), demand)]
    assert plan(waiting, [], demand_of, {"CPU": 2}, {"CPU": 1.0})[0][1] == ""


def test_a_run_waiting_for_the_cluster_holds_back_smaller_runs_behind_it() -> None:
    high, low = team("high", priority=1), team("low")
    waiting = [queued("big", 2.0, high, BIG), queued("small", 1.0, low)]
    decided = [(w.record.run_id, reason) for w, reason in plan(waiting, [], demand_of, {"CPU": 4})]
    assert decided == [
        ("big", "cluster CPU: needs 5, 4 of 4 free"),
        ("small", "cluster CPU: behind a run queued ahead of it that waits for CPU"),
    ]


class MemoryStore:
    def __init__(self) -> None:
        self.records: dict[str, RunRecord] = {}

    async def create(self, record: RunRecord) -> None:
        if record.run_id in self.records:
            raise KeyError(record.run_id)
        self.records[record.run_id] = RunRecord.from_json(record.to_json())

    async def get(self, run_id: str) -> RunRecord | None:
        record = self.records.get(run_id)
        return None if record is None else RunRecord.from_json(record.to_json())

    async def list(self) -> list[RunRecord]:
        return sorted([await self.get(k) for k in self.records], key=lambda r: r.created_at)

    async def update(self, run_id: str, change) -> RunRecord:
        record = await self.get(run_id)
        change(record)
        self.records[run_id] = record
        return record

    async def history(self, record: RunRecord) -> list[dict]:
        return []

    def forget(self, run_id: str) -> None:
        pass

    async def samples(self, record: RunRecord, every: int) -> list[dict]:
        return []

    async def weight_syncs(self, record: RunRecord) -> list[dict]:
        return []


class Cluster:
    def __init__(self, total: dict[str, float]) -> None:
        self.total_now = total

    async def total(self) -> dict[str, float]:
        return self.total_now

    async def state(self) -> ClusterState:
        return ClusterState(self.total_now, {})


def manager(tenants: list[Tenant], total: dict[str, float]) -> tuple[RunManager, list[str]]:
    runs = RunManager(
        None,  # type: ignore[arg-type]
        MemoryStore(),  # type: ignore[arg-type]
        Path("."),
        tenants={t.name: t for t in tenants},
        cluster=Cluster(total),  # type: ignore[arg-type]
    )
    driven: list[str] = []
    runs._drive = driven.append  # type: ignore[method-assign]
    return runs, driven


def test_runs_start_while_they_fit_queue_in_order_and_start_when_one_ends() -> None:
    low, high = team("low", priority=0), team("high", priority=3)
    runs, driven = manager([low, high], {"CPU": 4})

    async def check() -> None:
        first = await runs.create(RECIPE.format(name="first"), "first", low)
        second = await runs.create(RECIPE.format(name="second"), "second", low)
        assert (first.state, second.state) == ("pending", "pending") and driven == ["first", "second"]
        older = await runs.create(RECIPE.format(name="older"), "older", low)
        newer = await runs.create(RECIPE.format(name="newer"), "newer", high)
        assert (older.state, newer.state) == ("queued", "queued") and driven == ["first", "second"]
        queue = await runs.queue()
        assert queue == {"newer": (1, "cluster CPU: needs 2, 0 of 4 free"), "older": (2, queue["older"][1])}
        proto = await runs.proto(await runs.get("older", low))
        assert proto.state == gateway_pb2.RUN_STATE_QUEUED and proto.queue_position == 2
        # The higher-priority run goes first when a run ends, the older one stays queued.
        await runs.stop("first", low)
        assert driven == ["first", "second", "newer"]
        assert (await runs.get("newer", high)).state == "pending"
        assert await runs.queue() == {"older": (1, "cluster CPU: needs 2, 0 of 4 free")}
        # Stopping a queued run takes it out of the queue and starts nothing for it.
        stopped = await runs.stop("older", low)
        assert stopped.state == "stopped" and "older" not in driven and await runs.queue() == {}

    asyncio.run(check())


def test_a_run_that_can_never_fit_the_cluster_is_refused_and_creates_nothing() -> None:
    runs, driven = manager([team("a")], {"CPU": 4, "GPU": 0})

    async def check() -> None:
        with pytest.raises(ResourceExhausted) as err:
            await runs.create(BIG.format(name="big"), "big", team("a"))
        assert "needs 5 CPU" in err.value.message and "the cluster's total CPU=4" in err.value.message
        assert await runs.store.list() == [] and driven == []

    asyncio.run(check())


def test_a_run_that_ends_starts_the_next_queued_run() -> None:
    runs, driven = manager([team("a")], {"CPU": 2})

    async def check() -> None:
        await runs.create(RECIPE.format(name="first"), "first", team("a"))
        assert (await runs.create(RECIPE.format(name="next"), "next", team("a"))).state == "queued"
        await runs.store.update("first", lambda r: setattr(r, "state", "completed"))
        runs._ended("first")  # what the first run's driver calls as it ends
        await asyncio.gather(*runs._admitting)
        assert (await runs.get("next", team("a"))).state == "pending" and driven == ["first", "next"]

    asyncio.run(check())


def test_a_driver_reports_the_end_of_its_run_but_not_its_stop() -> None:
    async def check() -> list[str]:
        ended: list[str] = []
        for run_id, main in (("ends", lambda: asyncio.sleep(0)), ("stopped", lambda: asyncio.sleep(30))):
            driver = RunDriver(None, None, run_id)  # type: ignore[arg-type]
            driver._main = main  # type: ignore[method-assign]
            driver.on_end = ended.append
            driver.start()
            if run_id == "stopped":
                await asyncio.sleep(0.01)
                await driver.stop()
            else:
                await driver._task
            await asyncio.sleep(0)
        return ended

    assert asyncio.run(check()) == ["ends"]


def test_the_progress_line_of_a_queued_run_says_its_place_and_what_it_waits_for() -> None:
    run = gateway_pb2.Run(
        run_id="r", state=gateway_pb2.RUN_STATE_QUEUED, queue_position=2, queued_reason="cluster GPU: needs 2"
    )
    assert progress_line(run).endswith("| queue position 2: waits for cluster GPU: needs 2")


def test_a_tenant_allowed_no_runs_is_refused_rather_than_queued_forever() -> None:
    runs, driven = manager([], {"CPU": 8})
    with pytest.raises(ResourceExhausted, match="max_concurrent_runs=0"):
        asyncio.run(runs.create(RECIPE.format(name="x"), "x", team("none", runs=0)))
    assert driven == []


class SilentRouter:
    """An inference-router that cannot say the cluster's resources (the Ray head is down)."""

    async def GetClusterResources(self, request, timeout=None):
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no Ray head"
        )


def test_without_a_router_only_the_quotas_apply_and_an_unreadable_cluster_admits_nothing() -> None:
    assert asyncio.run(ClusterResources(None).total()) is None
    silent = ClusterResources(SilentRouter(), attempts=1)  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match=r"^cluster: the inference-router did not say .* no Ray head"):
        asyncio.run(silent.total())
    # Once read, a cluster that stops answering keeps its last total: never unlimited.
    silent._state, silent._read_at = ClusterState({"CPU": 8.0}, {}), float("-inf")
    assert asyncio.run(silent.total()) == {"CPU": 8.0}
    # The run that asked is not created.
    runs, driven = manager([], {})
    runs.cluster = silent
    silent._state = None
    with pytest.raises(Unavailable):
        asyncio.run(runs.create(RECIPE.format(name="x"), "x", team("a", runs=1)))
    assert driven == [] and asyncio.run(runs.store.list()) == []


def test_with_nothing_queued_admission_does_not_ask_the_cluster() -> None:
    """A fresh stack's gateway starts before the Ray head answers: with no queued run, resuming
    neither waits on the cluster nor logs a failure."""

    class Unanswered:
        asked = 0

        async def state(self) -> ClusterState:
            Unanswered.asked += 1
            raise Unavailable("cluster: not up yet")

    runs, driven = manager([team("a", runs=1)], {})
    runs.cluster = Unanswered()  # type: ignore[assignment]
    asyncio.run(runs.admit_queued())
    assert Unanswered.asked == 0 and driven == []


def test_lora_runs_of_a_shared_deployment_hold_its_replicas_once_and_wait_for_an_adapter_slot(
    tmp_path,
) -> None:
    from services.modeling.config import ModelConfig
    from services.modeling.qwen2 import Qwen2ForCausalLM

    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(tmp_path)
    lora = (
        RECIPE
        + f'[model]\npath = "{tmp_path}"\n[model.lora]\nrank = 8\n'
        + '[[deployments]]\nname = "lora"\nshared = true\nmax_loras = 2\n'
    )
    a = team("a", runs=5)
    running = RunRecord("r-1", lora.format(name="r-1"), state="running", created_at=0.0, tenant="a")
    waiting = [queued("r-2", 1.0, a, lora), queued("r-3", 2.0, a, lora)]
    # r-1 holds the shared replica (1 CPU) and its trainer (1): r-2 needs only a trainer and a slot.
    decided = dict((w.record.run_id, why) for w, why in plan(waiting, [running], demand_of, {"CPU": 8}))
    # CPUs: r-1 and r-2 hold 3 of 8 (the shared replica once); r-3 would fit them, not a slot
    assert waiting[0].demand.resources()["CPU"] == 2.0
    assert waiting[0].demand.resources(frozenset({"lora"}))["CPU"] == 1.0
    assert decided == {"r-2": "", "r-3": "cluster lora-slots:lora: needs 1, 0 of 2 free"}
    # without a cluster to read, the slots still count
    unread = dict((w.record.run_id, why) for w, why in plan(waiting, [running], demand_of, None))
    assert unread == {"r-2": "", "r-3": "cluster lora-slots:lora: needs 1, 0 of 2 free"}
