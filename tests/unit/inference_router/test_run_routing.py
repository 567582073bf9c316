"""Routing by run: a run's requests go to its own deployments (waiting while they start), other runs
fall back to the stack's shared deployments, and a pinned name resolves within the run.

The replicas are in-process fakes (test_router_core.FakeReplica); the router, its run scope, the
servicer's validation and the run watcher's bookkeeping are the real code.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.deployments import DeploymentManager
from services.inference_router.policies import DeploymentState, ReplicaState, RoutingPolicy
from services.inference_router.router import Router
from services.inference_router.runs import RunDeployments
from services.inference_router.servicer import validate_request
from services.kit.bus.kv import KVEntry
from services.kit.config.recipe import RunRecord
from services.kit.rpc import errors
from tests.unit.inference_router.test_router_core import FakeReplica


def _add(router: Router, name: str, run_id: str = "", for_run: bool = False) -> FakeReplica:
    fake = FakeReplica(f"{name}-r0")
    dep = DeploymentState(name=name, max_model_len=512, vocab_size=100, run_id=run_id, for_run=for_run)
    dep.replicas = [ReplicaState(name=fake.name, deployment=name)]
    router.add_deployment(dep, [fake])
    return fake


async def _router_with_runs() -> Router:
    router = Router(RoutingPolicy(), RouterConfig(version_wait_s=0.0, unavailable_wait_s=0.2))
    _add(router, "shared")
    _add(router, "A/gen", "A", for_run=True)
    _add(router, "B/gen", "B", for_run=True)
    await router.poll_once()
    return router


def _req(**kw) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=2), **kw
    )


def test_each_run_is_served_by_its_own_deployments_and_others_by_the_shared_ones():
    async def main():
        router = await _router_with_runs()
        for run_id, served in (("A", "A/gen"), ("B", "B/gen"), ("C", "shared"), ("", "shared")):
            replies = [await router.generate(_req(run_id=run_id)) for _ in range(4)]
            assert {r.deployment for r in replies} == {served}, run_id

    asyncio.run(main())


def test_a_pinned_name_means_the_runs_own_deployment_and_another_runs_is_refused():
    async def main():
        router = await _router_with_runs()
        assert (await router.generate(_req(run_id="A", deployment="gen"))).deployment == "A/gen"
        assert (await router.generate(_req(run_id="A", deployment="shared"))).deployment == "shared"
        # Without a run (the gateway's OpenAI endpoint), a scoped name is pinned as given.
        assert (await router.generate(_req(deployment="B/gen"))).deployment == "B/gen"
        with pytest.raises(errors.InvalidArgument, match=r"^deployment: 'B/gen' serves run 'B'"):
            validate_request(_req(run_id="A", deployment="B/gen"), router)
        with pytest.raises(errors.InvalidArgument, match=r"^deployment: 'B/gen' serves run 'B'"):
            await router.generate(_req(run_id="A", deployment="B/gen"))
        with pytest.raises(errors.InvalidArgument, match=r"^request\.deployment: unknown deployment 'nope'"):
            validate_request(_req(run_id="A", deployment="nope"), router, prefix="request.")

    asyncio.run(main())


def test_a_run_whose_deployments_are_starting_waits_for_them_instead_of_falling_back():
    async def main():
        router = await _router_with_runs()
        router.runs.begin("C", ["C/gen"])
        waiting = asyncio.ensure_future(router.generate(_req(run_id="C"), timeout_s=10))
        pinned = asyncio.ensure_future(router.generate(_req(run_id="C", deployment="gen"), timeout_s=10))
        await asyncio.sleep(0.5)  # longer than unavailable_wait_s: it does not give up, nor go to "shared"
        assert not waiting.done() and not pinned.done()
        fake = _add(router, "C/gen", "C", for_run=True)
        fake.version = -1  # replicas up, weights not yet there: still starting
        fake.broken = "no weights yet"
        router.runs.started("C")
        router.notify()
        await router.poll_once()
        await asyncio.sleep(0.3)
        assert not waiting.done()
        fake.version, fake.broken = 0, ""
        await router.poll_once()
        assert (await waiting).deployment == "C/gen"
        assert (await pinned).deployment == "C/gen"
        # Bounded by the request's deadline.
        router.runs.begin("D", ["D/gen"])
        with pytest.raises(errors.Unavailable, match="run 'D' has no deployment serving yet"):
            await router.generate(_req(run_id="D"), timeout_s=0.3)

    asyncio.run(main())


def test_a_run_whose_deployments_failed_to_start_is_told_why():
    async def main():
        router = await _router_with_runs()
        router.runs.fail("C", "RESOURCE_EXHAUSTED: no GPU")
        with pytest.raises(errors.Unavailable, match=r"run 'C': its deployments could not start: .*no GPU"):
            await router.generate(_req(run_id="C"))

    asyncio.run(main())


def test_a_removed_runs_deployment_leaves_routing():
    async def main():
        router = await _router_with_runs()
        routable = metrics.REPLICA_ROUTABLE.labels("A/gen", "A/gen-r0")
        assert routable._value.get() == 1
        await router.remove_deployment("A/gen")
        assert "A/gen" not in router.deployments and "A/gen-r0" not in router.replicas
        # Its replica no longer shows as routable on /metrics.
        assert ("A/gen", "A/gen-r0") not in metrics.REPLICA_ROUTABLE._metrics
        assert (await router.generate(_req(run_id="A"))).deployment == "shared"
        await router.poll_once()  # polls only what is left

    asyncio.run(main())


class _Manager:
    """The DeploymentManager's surface the run watcher uses, recording what it is asked."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = RouterConfig()
        self.started: list[tuple[str, str]] = []
        self.removed: list[str] = []
        self.unregistered: list[str] = []

    async def start(self, spec, ready_timeout_s, where, run_id):
        self.started.append((spec.name, run_id))
        _add(self.router, spec.name, run_id, for_run=True)

    async def remove(self, name, replicas):
        self.removed.append(name)
        return [] if await self.router.remove_deployment(name) is None else replicas

    async def unregister_targets(self, targets):
        self.unregistered += targets


class _Bus:
    def __init__(self) -> None:
        self.entries: asyncio.Queue = asyncio.Queue()

    async def kv(self, bucket):
        assert bucket == "runs"
        return self

    def watch(self, keys):
        assert keys == "*"
        return self

    async def start(self):
        return self

    async def stop(self):
        pass

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.entries.get()

    def put(self, run_id: str, state: str, recipe: str = "") -> None:
        toml = recipe or '[[deployments]]\nname = "gen"\n[[deployments]]\nname = "long"\nreplicas = 2\n'
        value = RunRecord(run_id=run_id, recipe_toml=toml, state=state).to_json()
        self.entries.put_nowait(KVEntry(run_id, value, 1))


def test_the_run_watcher_starts_active_runs_frees_ended_ones_and_skips_queued_and_bad_records():
    async def main():
        router = Router(RoutingPolicy(), RouterConfig())
        manager = _Manager(router)
        runs = RunDeployments(manager, router)  # type: ignore[arg-type]
        bus = _Bus()
        await runs.start(bus)
        bus.put("Q", "queued")
        bus.put("bad", "pending", recipe="[[deployments]]\nreplicas = -1\n")
        bus.put("gone", "completed")  # never started here: nothing to free
        bus.put("A", "pending")
        bus.put("B", "running")
        bus.put("A", "running")  # already served: not started twice
        await asyncio.sleep(0.2)
        assert sorted(manager.started) == [("A/gen", "A"), ("A/long", "A"), ("B/gen", "B"), ("B/long", "B")]
        assert sorted(d.name for d in router.deployment_list()) == ["A/gen", "A/long", "B/gen", "B/long"]
        assert manager.removed == [] and manager.unregistered == []

        bus.put("A", "stopped")
        bus.entries.put_nowait(KVEntry("B", b"", 2, deleted=True))
        await asyncio.sleep(0.2)
        assert router.deployment_list() == []
        assert sorted(manager.unregistered) == sorted(
            ["A/gen-r0", "A/long-r0", "A/long-r1", "B/gen-r0", "B/long-r0", "B/long-r1"]
        )
        bus.put("Q", "pending")  # its turn came
        await asyncio.sleep(0.2)
        assert [d.name for d in router.deployment_list()] == ["Q/gen", "Q/long"]
        await runs.stop()

    asyncio.run(main())


class _WeightSync:
    """Records what the router tells weight-sync; `down` makes every call fail as a dead server's."""

    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.registered: list = []
        self.unregistered: list[str] = []

    def _fail_if_down(self) -> None:
        if self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused"
            )

    async def RegisterTarget(self, request, timeout=None):
        self._fail_if_down()
        self.registered.append(request)
        return SimpleNamespace(current_version=-1)

    async def UnregisterTarget(self, request, timeout=None):
        self._fail_if_down()
        self.unregistered.append(request.deployment)


def test_a_runs_replicas_register_for_the_run_and_unregister_when_it_ends():
    async def main():
        router = Router(RoutingPolicy(), RouterConfig())
        manager = DeploymentManager(router, RouterConfig(weight_sync_address="recorded"))
        manager._weight_sync = _WeightSync()
        _add(router, "A/gen", "A", for_run=True)
        _add(router, "shared")

        async def addresses(replica):
            return ["127.0.0.1:1"], "host-a"

        manager._rank_addresses = addresses  # type: ignore[method-assign]
        for name in ("A/gen", "shared"):
            await manager.register_with_weight_sync(router.deployments[name], 1)
        assert {(r.deployment, r.run_id) for r in manager._weight_sync.registered} == {
            ("A/gen-r0", "A"),
            ("shared-r0", ""),
        }
        targets = await manager.remove("A/gen")
        assert targets == ["A/gen-r0"] and "A/gen" not in router.deployments
        await manager.unregister_targets(targets)
        assert manager._weight_sync.unregistered == ["A/gen-r0"]
        manager._weight_sync = _WeightSync(down=True)
        await manager.unregister_targets(["B/gen-r0"])  # logged, never raised

    asyncio.run(main())
