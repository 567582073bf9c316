"""Router core (failover, version waits, backpressure, restarts) against in-process fake replicas.

Only the replica is faked here (a tiny async object answering like InferenceReplica); the router,
its policies and the error mapping are the real code. Integration tests use real replicas.
"""

from __future__ import annotations

import asyncio

import pytest

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router.config import RouterConfig
from services.inference_router.handles import ReplicaFailure
from services.inference_router.policies import (
    DeploymentState,
    LengthProfile,
    ReplicaState,
    RoutingPolicy,
    SessionAffinity,
)
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.router import Router
from services.kit.rpc import errors


class FakeReplica:
    def __init__(self, name: str, version: int = 1, delay: float = 0.0) -> None:
        self.name = name
        self.version = version
        self.delay = delay
        self.fail_next = 0
        self.crash = False
        self.broken = ""  # what its engine's status says when it took itself out of service
        self.silent = False  # its host vanished: nothing it is asked ever answers
        self.calls = 0
        self.holds = False  # holds a request sent ahead of its version, as ReplicaCore does
        self.committed = asyncio.Event()

    async def generate(self, request, timeout_s):
        self.calls += 1
        if self.silent:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        if self.crash:
            raise ReplicaFailure(self.name, "actor died", crashed=True)
        if self.fail_next:
            self.fail_next -= 1
            raise ReplicaFailure(self.name, "boom")
        if request.prompt_token_ids[0] < 0:
            raise errors.InvalidArgument("prompt_token_ids: negative")
        if request.version_wait_ms and self.version < request.min_weight_version:
            try:
                await asyncio.wait_for(self.committed.wait(), request.version_wait_ms / 1000)
            except TimeoutError:
                raise errors.FailedPrecondition(
                    f"min_weight_version: {self.name} still serves {self.version}"
                ) from None
        comp = inference_pb2.Completion(
            token_ids=[7] * request.sampling.max_tokens, finish_reason="length", weight_version=self.version
        )
        return inference_pb2.GenerateResponse(completions=[comp], prompt_tokens=len(request.prompt_token_ids))

    async def generate_stream(self, request, timeout_s):
        if self.fail_next:
            self.fail_next -= 1
            raise ReplicaFailure(self.name, "boom")
        for i in range(request.sampling.max_tokens):
            yield inference_pb2.GenerateStreamResponse(index=0, token_ids=[i], weight_version=self.version)
        yield inference_pb2.GenerateStreamResponse(index=0, finish_reason="length")

    async def status(self, timeout_s):
        if self.silent:
            raise ReplicaFailure(self.name, f"status: no answer within {timeout_s}s")
        if self.crash:
            raise ReplicaFailure(self.name, "actor died", crashed=True)
        return ReplicaStatus(
            replica=self.name,
            weight_version=self.version,
            ready=not self.broken,
            address=f"fake:{self.name}",
            engine={"broken": self.broken} if self.broken else {},
            holds_for_version=self.holds,
        )

    async def close(self):
        pass


def _config(**settings) -> RouterConfig:
    """The router's settings with no wait for a missing weight version unless a test asks for one."""
    return RouterConfig(**{"version_wait_s": 0.0, **settings})


def _router(replicas=2, settings=None, per_replica=8, hook=None):
    dep = DeploymentState(name="d", profile=LengthProfile(), max_model_len=512)
    fakes = [FakeReplica(f"d-{i}") for i in range(replicas)]
    dep.replicas = [
        ReplicaState(name=f.name, deployment="d", max_outstanding_requests=per_replica) for f in fakes
    ]
    router = Router(RoutingPolicy(affinity=SessionAffinity()), settings or _config(), hook)
    router.add_deployment(dep, fakes)
    return router, fakes


def _request(max_tokens=4, **kw):
    return inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw
    )


async def test_failed_replica_is_retried_elsewhere_and_marked_unhealthy():
    router, fakes = _router()
    await router.poll_once()
    fakes[0].fail_next = fakes[1].fail_next = 0
    fakes[0].crash = True
    results = await asyncio.gather(*(router.generate(_request()) for _ in range(6)))
    assert all(r.replica == "d-1" and len(r.completions[0].token_ids) == 4 for r in results)
    assert not router.replicas["d-0"].routable


async def test_a_replica_failure_is_reported_to_the_run_whose_request_met_it():
    router, fakes = _router()
    reports: list[tuple[str, str]] = []

    async def report(run_id: str, message: str) -> None:
        reports.append((run_id, message))

    router.report_to_run = report
    await router.poll_once()
    fakes[0].crash = True
    served = [await router.generate(_request(run_id="run-7")) for _ in range(2)]
    await router.generate(_request())  # traffic outside a run is not reported anywhere
    await asyncio.sleep(0)
    assert all(r.replica == "d-1" for r in served)
    assert reports == [("run-7", "replica d-0 failed: actor died")]


async def test_attempts_are_bounded():
    router, fakes = _router(settings=_config(max_attempts=2, unavailable_wait_s=0))
    await router.poll_once()
    for f in fakes:
        f.fail_next = 5
    with pytest.raises(errors.Unavailable, match="failed on 2 replicas"):
        await router.generate(_request())
    assert sum(f.calls for f in fakes) == 2


async def test_bad_request_is_not_retried():
    router, fakes = _router()
    await router.poll_once()
    bad = inference_pb2.GenerateRequest(
        prompt_token_ids=[-1], sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    with pytest.raises(errors.InvalidArgument):
        await router.generate(bad)
    assert sum(f.calls for f in fakes) == 1


async def test_min_version_waits_for_an_update_then_serves():
    router, fakes = _router(settings=_config(version_wait_s=5))
    await router.poll_once()

    async def publish_later():
        await asyncio.sleep(0.2)
        fakes[1].version = 4
        await router.poll_once()

    task = asyncio.create_task(publish_later())
    response = await router.generate(_request(min_weight_version=4))
    await task
    assert response.replica == "d-1" and response.completions[0].weight_version == 4


async def test_a_committed_version_event_releases_waiting_requests_without_a_poll():
    router, fakes = _router(settings=_config(version_wait_s=5))
    await router.poll_once()

    async def commit_later():
        await asyncio.sleep(0.2)
        fakes[1].version = 4  # the replica swapped; weight-sync announces it, nobody polls
        router.on_replica_committed(router.replicas["d-1"], 4)

    task = asyncio.create_task(commit_later())
    response = await router.generate(_request(min_weight_version=4))
    await task
    assert response.replica == "d-1" and response.completions[0].weight_version == 4
    # An older or repeated announcement never moves a replica's version back.
    router.on_replica_committed(router.replicas["d-1"], 2)
    assert router.replicas["d-1"].weight_version == 4


async def test_requests_waiting_for_a_version_are_routed_again_only_when_versions_change():
    """Other requests finishing free room, which a request waiting for a version has no use for:
    it is routed once on arrival and once when its version lands, however many finish between."""
    router, fakes = _router(settings=_config(version_wait_s=5))
    await router.poll_once()
    waiting = [asyncio.create_task(router.generate(_request(min_weight_version=4))) for _ in range(4)]
    await asyncio.sleep(0.05)
    for _ in range(20):
        await router.generate(_request())
    assert not any(task.done() for task in waiting)
    decisions = len(router.decision_seconds)
    assert decisions == 4 + 20  # each waiting request's first try, then the 20 served
    fakes[1].version = 4
    router.on_replica_committed(router.replicas["d-1"], 4)
    served = await asyncio.gather(*waiting)
    assert all(r.completions[0].weight_version == 4 for r in served)
    assert len(router.decision_seconds) == decisions + 4


async def test_a_request_for_the_next_version_waits_on_a_replica_that_holds_it_not_on_the_router():
    """The replica starts it when it commits: the router hears of the commit later, or not at all."""
    router, fakes = _router(settings=_config(version_wait_s=5))
    fakes[1].holds = True
    await router.poll_once()
    pending = asyncio.ensure_future(router.generate(_request(min_weight_version=2)))
    await asyncio.sleep(0.05)
    assert fakes[1].calls == 1 and fakes[0].calls == 0 and not pending.done()
    fakes[1].version = 2
    fakes[1].committed.set()  # no poll, no committed event to the router
    response = await pending
    assert response.replica == "d-1" and response.completions[0].weight_version == 2
    # Two versions ahead is not the next commit: it waits on the router as before.
    with pytest.raises(errors.FailedPrecondition, match="no replica serves weight version >= 4"):
        await router.generate(_request(min_weight_version=4), timeout_s=0.2)
    assert fakes[1].calls == 1


@pytest.mark.parametrize(
    "code,kind", [("FAILED_PRECONDITION", errors.FailedPrecondition), ("UNAVAILABLE", errors.Unavailable)]
)
async def test_a_request_held_ahead_whose_version_never_comes_fails_like_one_waiting_here(code, kind):
    router, fakes = _router(settings=_config(version_wait_s=0.1, version_unavailable_code=code))
    fakes[0].holds = True
    await router.poll_once()
    with pytest.raises(kind, match=r"^min_weight_version: d-0 still serves 1"):
        await router.generate(_request(min_weight_version=2))
    assert fakes[0].calls == 1


@pytest.mark.parametrize(
    "code,kind", [("FAILED_PRECONDITION", errors.FailedPrecondition), ("UNAVAILABLE", errors.Unavailable)]
)
async def test_min_version_fails_with_the_configured_status(code, kind):
    router, _ = _router(settings=_config(version_wait_s=0.1, version_unavailable_code=code))
    await router.poll_once()
    with pytest.raises(
        kind, match=r"min_weight_version: no replica serves weight version >= 9 \(newest available: 1\)"
    ):
        await router.generate(_request(min_weight_version=9))


async def test_backpressure_answers_resource_exhausted_with_a_retry_hint():
    router, fakes = _router(replicas=1, per_replica=2)
    fakes[0].delay = 0.3
    await router.poll_once()
    running = [asyncio.create_task(router.generate(_request())) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(errors.ResourceExhausted) as err:
        await router.generate(_request())
    assert err.value.retry_after_s and err.value.retry_after_s > 0
    assert ("retry-after-ms", str(int(err.value.retry_after_s * 1000))) in err.value.trailing_metadata()
    assert all(r.completions for r in await asyncio.gather(*running))
    assert router.replicas["d-0"].outstanding_requests == 0


async def test_restarted_replica_waits_for_the_newest_version_and_asks_for_it():
    asked = []

    async def hook(deployment, replica):
        asked.append((deployment, replica))

    router, fakes = _router(hook=hook)
    for f in fakes:
        f.version = 3
    await router.poll_once()
    fakes[0].version = -1  # restarted without weights
    await router.poll_once()
    await asyncio.sleep(0)
    assert asked == [("d", "d-0")]
    assert not router.replicas["d-0"].routable
    assert {(await router.generate(_request())).replica for _ in range(4)} == {"d-1"}
    fakes[0].version = 3
    await router.poll_once()
    assert router.replicas["d-0"].routable


async def test_a_broken_replica_is_routed_around_recreated_once_and_resynced():
    """A replica whose engine took itself out of service (mixed weights after a failed swap) is
    recreated (once, however many polls see it) and, back without weights, resynced like a restart."""
    recreate, resync = [], []

    async def restarted(deployment, replica):
        resync.append((deployment, replica))

    async def broken(deployment, replica, why):
        recreate.append((deployment, replica, why))

    router, fakes = _router(hook=restarted)
    router._on_replica_broken = broken
    for f in fakes:
        f.version = 3
    await router.poll_once()
    fakes[0].broken = "version 4 failed while loading"
    for _ in range(3):
        await router.poll_once()
    await asyncio.sleep(0)
    assert recreate == [("d", "d-0", "version 4 failed while loading")]
    assert not router.replicas["d-0"].routable and "failed while loading" in router.replicas["d-0"].last_error
    assert {(await router.generate(_request())).replica for _ in range(4)} == {"d-1"}
    fakes[0].broken, fakes[0].version = "", -1  # the recreated process, without weights
    await router.poll_once()
    await asyncio.sleep(0)
    assert resync == [("d", "d-0")] and not router.replicas["d-0"].routable
    fakes[0].version = 3
    await router.poll_once()
    assert router.replicas["d-0"].routable


async def test_session_sticks_and_moves_when_its_replica_dies():
    router, fakes = _router()
    await router.poll_once()
    first = await router.generate(_request(session_id="s"))
    for _ in range(3):
        assert (await router.generate(_request(session_id="s"))).replica == first.replica
    fakes[int(first.replica[-1])].crash = True
    moved = await router.generate(_request(session_id="s"))
    assert moved.replica != first.replica


async def test_stream_fails_over_before_the_first_chunk():
    router, fakes = _router()
    await router.poll_once()
    fakes[0].fail_next = 100  # whichever replica is chosen first, d-1 ends up serving
    chunks = [c async for c in router.generate_stream(_request(max_tokens=3))]
    assert [t for c in chunks for t in c.token_ids] == [0, 1, 2]
    assert chunks[-1].finish_reason == "length"


async def test_requests_in_flight_on_a_replica_that_stops_answering_move_elsewhere():
    """A replica whose host vanished holds its requests until request_timeout_s unless the failed
    status poll releases them: they must finish on another replica long before that."""
    router, fakes = _router(settings=_config(request_timeout_s=60.0))
    await router.poll_once()
    fakes[0].silent = True
    started = asyncio.get_running_loop().time()
    pending = [asyncio.ensure_future(router.generate(_request())) for _ in range(4)]
    await asyncio.sleep(0.05)
    assert fakes[0].calls > 0, "no request went to the replica that will go silent"
    await router.poll_once()
    results = await asyncio.wait_for(asyncio.gather(*pending), timeout=5)
    assert all(r.replica == "d-1" for r in results)
    assert asyncio.get_running_loop().time() - started < 5
    assert not router.replicas["d-0"].routable
    # Answering again: it is polled back into routing and its requests no longer give up at once.
    fakes[0].silent = False
    await router.poll_once()
    assert router.replicas["d-0"].routable
    assert "d-0" not in router._unreachable


async def test_a_status_answer_older_than_a_commit_seen_meanwhile_is_not_taken_for_a_restart():
    router, fakes = _router(replicas=1)
    await router.poll_once()
    replica, fake = router.replicas["d-0"], fakes[0]
    answered = asyncio.Event()
    status = fake.status

    async def slow_status(timeout_s):
        reply = await status(timeout_s)  # version 1, as the replica was when asked
        await answered.wait()
        return reply

    fake.status = slow_status
    poll = asyncio.create_task(router.poll_once())
    await asyncio.sleep(0.05)  # the poll is out, waiting for its answer
    router.on_replica_committed(replica, 2)  # weight-sync's event overtakes the status answer
    answered.set()
    await poll
    assert replica.weight_version == 2 and replica.resync_to_version is None
    # A replica that really lost its weights answers below what it had when asked.
    fake.status, fake.version = status, 0
    await router.poll_once()
    assert replica.weight_version == 0 and replica.resync_to_version is not None
