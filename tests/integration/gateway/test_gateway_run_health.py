"""Runs that say what is wrong, against a real gateway process and a real nats-server: a run with
nothing to serve it is refused at CreateRun and never exists; a run that stops progressing reads
STALLED with the component and the error it reported, and RUNNING again once it progresses.

The test plays the trainer's and the environment-sandbox's parts on the bus (TrainStepRecords, and
RunErrors through the kit's real reporter); tests/e2e/test_run_health.py stalls a whole stack.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from looprl.gateway.v1 import gateway_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.local.infra import free_port
from services.kit.messages.run_errors import RunErrorReporter
from tests.integration.gateway.test_gateway_runs import publish_train_step
from tests.support.gateway import AUTH, GatewayProcess
from tests.support.service_process import service_process

STALL_S = 2.0
RECIPE = f"""
[run]
name = "health"
steps = 3
stall_seconds = {STALL_S}
[batch]
rollouts_per_step = 4
group_size = 2
"""


@pytest.fixture
def gateway(nats_url: str, tmp_path: Path):
    gw = GatewayProcess(nats_url, tmp_path).start()
    yield gw
    gw.kill()


def get_run(gateway: GatewayProcess, run_id: str) -> gateway_pb2.Run:
    return gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=AUTH).run


def wait_for_run(
    gateway: GatewayProcess, run_id: str, predicate, timeout: float
) -> tuple[gateway_pb2.Run, float]:
    """The run once predicate(run) holds, and the seconds it took."""
    started = time.monotonic()
    while True:
        run = get_run(gateway, run_id)
        if predicate(run):
            return run, time.monotonic() - started
        assert time.monotonic() - started < timeout, f"not met in {timeout}s: {run}"
        time.sleep(0.1)


def report(nats_url: str, run_id: str, component: str, messages: list[str], fatal: bool = False) -> int:
    """Report `messages` as one component would (a burst: rate-limited; with fatal, the last one is
    the component giving up on the run); the RunErrors sent."""

    async def send() -> int:
        bus = await Bus.connect(nats_url, name=f"test-{component}")
        reporter = RunErrorReporter(bus, component, interval_s=1.0)
        for i, message in enumerate(messages):
            await reporter.report(run_id, message, fatal=fatal and i == len(messages) - 1)
        await reporter.close()
        await bus.close()
        return reporter.sent

    return asyncio.run(send())


def count_events(nats_url: str, run_id: str) -> int:
    async def count() -> int:
        bus = await Bus.connect(nats_url, name="test-count")
        try:
            return await bus.count(subjects.RUN_EVENTS, subjects.events(run_id))
        finally:
            await bus.close()

    return asyncio.run(count())


def test_a_run_without_progress_is_stalled_naming_the_reported_error_and_recovers(
    gateway: GatewayProcess, nats_url: str
) -> None:
    run_id = gateway.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=RECIPE), metadata=AUTH
    ).run.run_id
    # Nothing trains step 0: once its tasks are out, the run is idle and stalls after STALL_S.
    run, took = wait_for_run(
        gateway, run_id, lambda r: r.state == gateway_pb2.RUN_STATE_STALLED, timeout=STALL_S + 10
    )
    assert took < STALL_S + 5
    assert "no progress at step 0/3" in run.stalled_reason
    assert "no component reported an error" in run.stalled_reason
    # A burst of 40 episode failures: a handful of bus messages, every occurrence counted.
    burst = [f"episode {i} failed: UNAVAILABLE: replica default-r0 is not serving" for i in range(40)]
    sent = report(nats_url, run_id, "environment-sandbox", burst)
    assert sent <= 2 and count_events(nats_url, run_id) == sent
    run, _ = wait_for_run(gateway, run_id, lambda r: "environment-sandbox" in r.stalled_reason, timeout=10)
    assert run.state == gateway_pb2.RUN_STATE_STALLED
    assert "environment-sandbox reported (40 errors reported): episode 39 failed: UNAVAILABLE" in (
        run.stalled_reason
    )
    assert run.last_error.component == "environment-sandbox" and run.last_error.occurrences == 40
    # The trainer trains step 0: the run progresses, so it is RUNNING again, the error still shown.
    publish_train_step(nats_url, run_id, 0)
    run, _ = wait_for_run(gateway, run_id, lambda r: r.state == gateway_pb2.RUN_STATE_RUNNING, timeout=10)
    assert run.stalled_reason == "" and run.step == 1
    assert run.last_error.component == "environment-sandbox"
    # Idle again; an error older than the last progress is not named as the cause.
    run, _ = wait_for_run(
        gateway, run_id, lambda r: r.state == gateway_pb2.RUN_STATE_STALLED, timeout=STALL_S + 10
    )
    assert "no progress at step 1/3" in run.stalled_reason
    assert "no component reported an error since the last progress" in run.stalled_reason
    report(nats_url, run_id, "trainer", ["pushing version 2 to weight-sync failed: UNAVAILABLE"])
    run, _ = wait_for_run(gateway, run_id, lambda r: "trainer reported" in r.stalled_reason, timeout=10)
    assert "pushing version 2 to weight-sync failed" in run.stalled_reason


def test_a_component_that_gives_up_fails_the_run_with_its_reason(
    gateway: GatewayProcess, nats_url: str
) -> None:
    run_id = gateway.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=RECIPE), metadata=AUTH
    ).run.run_id
    wait_for_run(gateway, run_id, lambda r: r.episodes_published > 0, timeout=10)
    give_up = "training failed at step 0: RuntimeError: pushing version 1 to weight-sync failed 9 times"
    report(
        nats_url, run_id, "trainer", ["pushing version 1 failed, retrying: UNAVAILABLE", give_up], fatal=True
    )
    run, took = wait_for_run(gateway, run_id, lambda r: r.state == gateway_pb2.RUN_STATE_FAILED, timeout=10)
    assert run.error == f"trainer: {give_up}"
    assert took < 5, "a fatal report is sent at once, not held back by the rate limit"
    # The run is over: its watch ends, and no more steps are fed.
    updates = list(
        gateway.stub.WatchRun(gateway_pb2.WatchRunRequest(run_id=run_id), metadata=AUTH, timeout=10)
    )
    assert updates[-1].run.state == gateway_pb2.RUN_STATE_FAILED
    time.sleep(1.5)
    assert get_run(gateway, run_id).episodes_published == run.episodes_published


def test_a_stalled_run_names_the_service_that_is_not_serving(nats_url: str, tmp_path: Path) -> None:
    gw = GatewayProcess(nats_url, tmp_path)
    gw.env["LOOPRL_GATEWAY_PACKER_ADDRESS"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    gw.start()
    try:
        run_id = gw.stub.CreateRun(gateway_pb2.CreateRunRequest(recipe_toml=RECIPE), metadata=AUTH).run.run_id
        run, _ = wait_for_run(
            gw, run_id, lambda r: r.state == gateway_pb2.RUN_STATE_STALLED, timeout=STALL_S + 10
        )
        assert "; not serving: rollout-packer (DOWN: UNAVAILABLE)" in run.stalled_reason
    finally:
        gw.kill()


def test_stall_seconds_is_bounded(gateway: GatewayProcess) -> None:
    for value in ("0.5", "nan", "1e9"):
        recipe = RECIPE.replace(f"stall_seconds = {STALL_S}", f"stall_seconds = {value}")
        with pytest.raises(grpc.RpcError) as err:
            gateway.stub.CreateRun(gateway_pb2.CreateRunRequest(recipe_toml=recipe), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "run.stall_seconds" in err.value.details()


@pytest.mark.slow
def test_a_router_serving_only_configured_deployments_refuses_a_run_naming_none_of_them(
    ray_head, nats_url: str, tmp_path: Path
) -> None:
    # A router that starts no run's own deployments, configured with none.
    env = {
        "LOOPRL_NATS_URL": nats_url,
        "LOOPRL_INFERENCE_ROUTER_NAMESPACE": "looprl-health-test",
        "LOOPRL_INFERENCE_ROUTER_WATCH_RUNS": "false",
    }
    with service_process("services.inference_router", env, timeout=120) as router:
        gw = GatewayProcess(nats_url, tmp_path, router_address=router.address).start()
        try:
            before = gw.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH).runs
            with pytest.raises(grpc.RpcError) as err:
                gw.stub.CreateRun(
                    gateway_pb2.CreateRunRequest(recipe_toml=RECIPE, run_id="served-by-nobody"), metadata=AUTH
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details().startswith("deployments: no deployment serves this run")
            assert "the inference-router serves none (it serves only its configured" in err.value.details()
            after = gw.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH).runs
            assert [r.run_id for r in after] == [r.run_id for r in before]
            assert "served-by-nobody" not in [r.run_id for r in after]
        finally:
            gw.kill()
