"""The gateway as a real process against a real nats-server: auth, recipe validation and bounds
(gRPC and HTTP, OpenAI-shaped errors), the staleness gate on episode feeding, and a restarted
gateway continuing a run.

The test plays the trainer's part on the bus (publishing TrainStepRecords) so that the gateway's
run control is observable on its own; the end-to-end test runs the real trainer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from gateway.progress import progress_line
from looprl.events.v1 import events_pb2
from looprl.gateway.v1 import gateway_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.local.infra import NatsServer, free_port
from services.kit.messages import trainer_epochs
from tests.support.gateway import AUTH, TOKEN, GatewayProcess, http, openai_error

RECIPE = """
[run]
name = "gw"
steps = 3
max_staleness = {staleness}
[batch]
rollouts_per_step = 4
group_size = 2
"""


@pytest.fixture
def gateway(nats_url: str, tmp_path: Path):
    gw = GatewayProcess(nats_url, tmp_path).start()
    yield gw
    gw.kill()


def create_run(
    gateway: GatewayProcess, run_id: str, recipe: str = RECIPE.format(staleness=0)
) -> gateway_pb2.Run:
    request = gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id=run_id)
    return gateway.stub.CreateRun(request, metadata=AUTH).run


def episodes_of(nats_url: str, run_id: str) -> list[events_pb2.EpisodeTask]:
    async def read() -> list[events_pb2.EpisodeTask]:
        bus = await Bus.connect(nats_url, name="test-reader")
        consumer = await bus.pull_consumer(
            subjects.EPISODES, f"peek-{run_id}-{time.monotonic_ns()}", subjects.episodes(run_id)
        )
        tasks: dict[str, events_pb2.EpisodeTask] = {}
        # Peek without acking: deleting the consumer leaves every task in the work queue.
        while batch := await consumer.fetch(batch=256, timeout=0.3):
            for delivery in batch:
                task = delivery.parse(events_pb2.EpisodeTask)
                tasks[task.task_id] = task
        await consumer.close()
        await bus.delete_consumer(subjects.EPISODES, consumer.durable)
        await bus.close()
        return list(tasks.values())

    return asyncio.run(read())


def open_trainer_epoch(nats_url: str, run_id: str, from_step: int) -> str:
    """What a trainer does before training a run's steps from `from_step`: its epoch id."""

    async def open_epoch() -> str:
        bus = await Bus.connect(nats_url, name="test-trainer")
        try:
            return await trainer_epochs.open_epoch(await bus.kv(subjects.TRAINER_EPOCHS), run_id, from_step)
        finally:
            await bus.close()

    return asyncio.run(open_epoch())


def publish_train_step(nats_url: str, run_id: str, step: int, epoch: str | None = None) -> None:
    """Publish the step record a trainer would; without `epoch`, as a trainer just started at `step`."""
    epoch = open_trainer_epoch(nats_url, run_id, step) if epoch is None else epoch

    async def publish() -> None:
        bus = await Bus.connect(nats_url, name="test-trainer")
        record = events_pb2.TrainStepRecord(
            run_id=run_id,
            step=step,
            version=step + 1,
            reward_mean=0.1 * step,
            num_rollouts=4,
            trainer_epoch=epoch,
        )
        await bus.publish(subjects.train(run_id), record, msg_id=f"{run_id}-train-{step}-{epoch}")
        await bus.close()

    asyncio.run(publish())


def wait_until(predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_every_call_needs_a_valid_token(gateway: GatewayProcess) -> None:
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as err:
            gateway.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}/v1/runs")
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=5)
    assert http_err.value.code == 401
    request.add_header("Authorization", f"Bearer {TOKEN}")
    assert "runs" in json.loads(urllib.request.urlopen(request, timeout=5).read())


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ("[run]\nsteps = 2\nsurprise = 1\n", "run.surprise"),
        ("[model]\npath = 'no/such/model'\n", "model.path"),
        ("[batch]\nrollouts_per_step = 6\ngroup_size = 4\n", "batch.rollouts_per_step"),
        # Out of range: refused by the bounds before a run record exists (steps = 2**64 used to
        # create the run and then answer INTERNAL).
        ("[run]\nsteps = 18446744073709551616\n", "run.steps: must be <= 1000000"),
        ("[batch]\nrollouts_per_step = 8000000\n", "batch.rollouts_per_step: must be <= 65536"),
        ("[sampling]\nmax_tokens = 1000000000000\n", "sampling.max_tokens"),
        ("[trainer]\nworld_size = 1000000\n", "trainer.world_size"),
        ("[[deployments]]\nreplicas = 100000000\n", "deployments[0].replicas"),
        ("[environment.config]\nblob = '" + "x" * 2_000_000 + "'\n", "max_recipe_bytes (262144)"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else v,
)
def test_bad_recipes_are_rejected_and_nothing_starts(
    gateway: GatewayProcess, recipe: str, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        create_run(gateway, "bad-run", recipe)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert err.value.details().startswith("recipe_toml: ")
    with pytest.raises(grpc.RpcError) as missing:
        gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id="bad-run"), metadata=AUTH)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "bad-run" not in [
        r.run_id for r in gateway.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH).runs
    ]


OUT_OF_RANGE = [
    ("/v1/completions", {"prompt": [1, 2, 2**40]}, "prompt", "prompt[2]: token id 1099511627776"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt", "list of token ids"),
    ("/v1/completions", {"prompt": []}, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": "12", "max_tokens": 10**12}, "max_tokens", "[1, 131072]"),
    ("/v1/completions", {"prompt": "12", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ("/v1/completions", {"prompt": "12", "seed": 2**70}, "seed", "1180591620717411303424"),
    ("/v1/completions", {"prompt": "12", "n": -1}, "n", "must be in [1, 128]"),
    ("/v1/completions", {"prompt": "12", "temperature": "hot"}, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "12", "temperature": float("nan")}, "temperature", "finite"),
    ("/v1/completions", {"prompt": "12", "top_p": 7}, "top_p", "must be in [0.0, 1.0]"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12},
        "max_tokens",
        "[1, 131072]",
    ),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty list"),
    (
        "/v1/runs",
        {"recipe_toml": "[run]\nsteps = 18446744073709551616\n", "run_id": "bad-http"},
        "recipe_toml",
        "run.steps: must be <= 1000000",
    ),
    (
        "/v1/runs",
        {"recipe_toml": "[batch]\nrollouts_per_step = 8000000\n", "run_id": "bad-http"},
        "recipe_toml",
        "batch.rollouts_per_step",
    ),
    ("/v1/runs", {"recipe_toml": "x" * 2_000_000, "run_id": "bad-http"}, "recipe_toml", "max_recipe_bytes"),
]


def test_http_answers_out_of_range_fields_with_openai_400s_and_keeps_serving(gateway: GatewayProcess) -> None:
    for path, body, param, text in OUT_OF_RANGE:
        status, reply = http(gateway, path, body)
        error = openai_error(reply)
        assert (status, error["type"], error["param"], error["code"]) == (
            400,
            "invalid_request_error",
            param,
            "INVALID_ARGUMENT",
        ), (path, body.get("recipe_toml", body)[:80] if "recipe_toml" in body else body, reply)
        assert text in error["message"], (path, error)
    status, reply = http(gateway, "/v1/completions", b"[" * (5 << 20))  # past the 4 MiB body limit
    assert status == 413 and openai_error(reply)["type"] == "invalid_request_error"
    assert http(gateway, "/v1/runs/bad-http")[0] == 404
    # Still serving: a valid completion gets past validation (no router here: 503, OpenAI-shaped),
    # and a valid run is created.
    status, reply = http(gateway, "/v1/completions", {"prompt": [1, 2], "max_tokens": 4, "seed": 2**63 - 1})
    assert status == 503 and openai_error(reply)["type"] == "server_error"
    recipe = RECIPE.format(staleness=0)
    status, reply = http(gateway, "/v1/runs", {"recipe_toml": recipe, "run_id": "after-bad-input"})
    assert status == 201 and reply["run_id"] == "after-bad-input"


def test_the_http_run_api_answers_json_numbers_and_streams_a_watch_until_the_run_ends(
    gateway: GatewayProcess, nats_url: str
) -> None:
    status, created = http(
        gateway, "/v1/runs", {"recipe_toml": RECIPE.format(staleness=0), "run_id": "http-watch"}
    )
    assert status == 201 and created["total_steps"] == 3 and isinstance(created["total_steps"], int)
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}/v1/runs/http-watch/watch")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(request, timeout=60) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        events = []
        for line in stream:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
                if len(events) == 1:
                    for step in range(3):  # the run trains to its end while the stream is open
                        publish_train_step(nats_url, "http-watch", step)
    assert events[0]["run_id"] == "http-watch" and events[-1]["state"] == "RUN_STATE_COMPLETED"
    final = events[-1]
    assert (
        final["step"] == 3 and final["weight_version"] == 3 and isinstance(final["episodes_published"], int)
    )
    assert [h["step"] for h in final["history"]] == [0, 1, 2]
    assert all(isinstance(h["num_rollouts"], int) for h in final["history"])
    assert http(gateway, "/v1/runs/nope/watch")[0] == 404


def plan_packer_step(nats_url: str, run_id: str, step: int) -> None:
    """Write the plan the packer writes when a step's batch is complete (its key is what counts)."""

    async def plan() -> None:
        bus = await Bus.connect(nats_url, name="test-packer")
        try:
            await (await bus.kv(subjects.PACKER_STEPS)).put(subjects.packer_step_key(run_id, step), b"{}")
        finally:
            await bus.close()

    asyncio.run(plan())


def test_synchronous_run_feeds_the_next_step_once_the_current_one_is_planned(
    gateway: GatewayProcess, nats_url: str
) -> None:
    run = create_run(gateway, "sync-run")
    wait_until(lambda: len(episodes_of(nats_url, run.run_id)) == 2)
    time.sleep(1.0)
    tasks = episodes_of(nats_url, run.run_id)
    # Step 0 only: one task per group (2 groups of 2), each forking into its group's samples.
    assert {(t.step, t.min_weight_version) for t in tasks} == {(0, 0)} and len(tasks) == 2
    assert {(t.branches, t.branch_at_turn, t.group_size) for t in tasks} == {(2, 0, 1)}
    # The packer planned step 0 (the trainer is training it): step 1 goes out, waiting for version 1.
    plan_packer_step(nats_url, run.run_id, 0)
    tasks = wait_until(lambda: [t for t in episodes_of(nats_url, run.run_id) if t.step == 1])
    assert len(tasks) == 2 and {t.min_weight_version for t in tasks} == {1}
    assert len({t.group_id for t in episodes_of(nats_url, run.run_id)}) == 4
    # Version 1 trained: step 2 waits for step 1's plan, and comes with it.
    publish_train_step(nats_url, run.run_id, 0)
    time.sleep(1.0)
    assert max(t.step for t in episodes_of(nats_url, run.run_id)) == 1
    plan_packer_step(nats_url, run.run_id, 1)
    tasks = wait_until(lambda: [t for t in episodes_of(nats_url, run.run_id) if t.step == 2])
    assert {t.min_weight_version for t in tasks} == {2}


def test_a_synchronous_run_without_plans_is_fed_by_its_trained_versions(
    gateway: GatewayProcess, nats_url: str
) -> None:
    run = create_run(gateway, "unplanned-run")
    wait_until(lambda: episodes_of(nats_url, run.run_id))
    publish_train_step(nats_url, run.run_id, 0)
    tasks = wait_until(lambda: [t for t in episodes_of(nats_url, run.run_id) if t.step == 1])
    assert {t.min_weight_version for t in tasks} == {1}
    time.sleep(1.0)
    assert max(t.step for t in episodes_of(nats_url, run.run_id)) == 1


def test_unforked_groups_publish_one_task_per_sample(gateway: GatewayProcess, nats_url: str) -> None:
    recipe = RECIPE.format(staleness=0) + "fork_groups = false\n"
    run = create_run(gateway, "unforked-run", recipe)
    wait_until(lambda: len(episodes_of(nats_url, run.run_id)) == 4)  # step 0 (step 1 waits for its plan)
    tasks = episodes_of(nats_url, run.run_id)
    assert {t.step for t in tasks} == {0} and {(t.branches, t.group_size) for t in tasks} == {(0, 2)}
    assert sorted(t.sample_index for t in tasks) == [0, 0, 1, 1]


def test_async_run_feeds_one_step_past_the_staleness_bound(gateway: GatewayProcess, nats_url: str) -> None:
    run = create_run(gateway, "async-run", RECIPE.format(staleness=2).replace("steps = 3", "steps = 6"))
    wait_until(lambda: len(episodes_of(nats_url, run.run_id)) == 8)
    time.sleep(1.0)
    tasks = episodes_of(nats_url, run.run_id)
    # Up to the bound (steps 0-2 may sample version 0) and one step ahead of it, waiting for version 1.
    assert sorted({t.step for t in tasks}) == [0, 1, 2, 3]
    assert {(t.step, t.min_weight_version) for t in tasks} == {(0, 0), (1, 0), (2, 0), (3, 1)}


def test_step_records_of_an_unknown_or_stale_trainer_epoch_are_ignored_and_counted(
    gateway: GatewayProcess, nats_url: str
) -> None:
    run = create_run(gateway, "epoch-run")

    def current() -> gateway_pb2.Run:
        return gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), metadata=AUTH).run

    first = open_trainer_epoch(nats_url, run.run_id, 0)
    publish_train_step(nats_url, run.run_id, 0, epoch=first)
    wait_until(lambda: current().step == 1)
    # A record no trainer epoch vouches for (forged with the trainer's subject) changes nothing.
    publish_train_step(nats_url, run.run_id, 1, epoch="0123456789abcdef")
    wait_until(lambda: current().step_records_ignored == 1)
    # The trainer restarts and resumes at step 1: a record of step 1 from the old epoch is stale.
    second = open_trainer_epoch(nats_url, run.run_id, 1)
    publish_train_step(nats_url, run.run_id, 1, epoch=first)
    wait_until(lambda: current().step_records_ignored == 2)
    assert current().step == 1 and [h.step for h in current().history] == [0]
    publish_train_step(nats_url, run.run_id, 1, epoch=second)
    final = wait_until(lambda: (r := current()).step == 2 and r)
    assert [h.step for h in final.history] == [0, 1] and final.step_records_ignored == 2
    assert "ignored step records 2" in progress_line(final)


def test_unparsable_records_are_terminated_and_the_run_goes_on(
    gateway: GatewayProcess, nats_url: str
) -> None:
    """A record that is not the message its subject carries is terminated (never redelivered to
    the run's driver) and the records after it count."""
    run = create_run(gateway, "garbled-run")
    streams = {subjects.TRAIN: "train", subjects.WEIGHTS: "weights", subjects.RUN_EVENTS: "events"}

    async def garble() -> None:
        bus = await Bus.connect(nats_url, name="test-trainer")
        for subject in (subjects.train, subjects.weights, subjects.events):
            await bus.js.publish(subject(run.run_id), b"\xff\xffnot a protobuf")
        await bus.close()

    async def unsettled() -> dict[str, int]:
        bus = await Bus.connect(nats_url, name="test-reader")
        try:
            infos = [await bus.js.consumer_info(s, f"gateway-{k}-{run.run_id}") for s, k in streams.items()]
            return {i.stream_name: i.num_ack_pending + i.num_pending for i in infos}
        finally:
            await bus.close()

    asyncio.run(garble())
    publish_train_step(nats_url, run.run_id, 0)

    def current() -> gateway_pb2.Run:
        return gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), metadata=AUTH).run

    final = wait_until(lambda: (r := current()).step == 1 and r)
    assert [h.step for h in final.history] == [0]
    assert wait_until(lambda: set(asyncio.run(unsettled()).values()) == {0})


def test_a_run_is_fed_and_watched_on_after_the_bus_stopped_answering_past_a_request_timeout(
    tmp_path: Path,
) -> None:
    """A nats-server that answers nothing for longer than a request's 5 s timeout (frozen, or
    restarted with requests in flight) costs the run's driver none of its tasks: it records and
    feeds the next step after, and still marks the run stalled once it stops progressing."""
    server = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    gateway = GatewayProcess(server.url, tmp_path / "gateway").start()
    try:
        recipe = RECIPE.format(staleness=0).replace("[batch]", "stall_seconds = 3\n[batch]")
        create_run(gateway, "frozen-bus", recipe)
        wait_until(lambda: episodes_of(server.url, "frozen-bus"))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(7.0)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        publish_train_step(server.url, "frozen-bus", 0)
        plan_packer_step(server.url, "frozen-bus", 1)
        wait_until(lambda: any(t.step == 2 for t in episodes_of(server.url, "frozen-bus")))

        def get_run() -> gateway_pb2.Run:
            return gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id="frozen-bus"), metadata=AUTH).run

        run = wait_until(lambda: (r := get_run()).state == gateway_pb2.RUN_STATE_STALLED and r, timeout=30)
        assert [h.step for h in run.history] == [0]
        assert "no progress at step 1/3" in run.stalled_reason, run.stalled_reason
    finally:
        gateway.kill()
        server.stop()


def test_restarted_gateway_continues_the_run(gateway: GatewayProcess, nats_url: str) -> None:
    run = create_run(gateway, "restart-run")
    wait_until(lambda: episodes_of(nats_url, run.run_id))
    gateway.kill()
    publish_train_step(nats_url, run.run_id, 0)
    gateway.start()
    wait_until(lambda: any(t.step == 1 for t in episodes_of(nats_url, run.run_id)))
    for step in (1, 2):
        publish_train_step(nats_url, run.run_id, step)
    final = wait_until(
        lambda: (
            (r := gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), metadata=AUTH).run).state
            == gateway_pb2.RUN_STATE_COMPLETED
            and r
        )
    )
    assert [h.step for h in final.history] == [0, 1, 2]
    assert final.weight_version == 3
    assert len(episodes_of(nats_url, run.run_id)) == 6  # each step's episodes published once


def test_a_completed_run_reports_every_weight_delivery_already_on_the_bus(
    gateway: GatewayProcess, nats_url: str
) -> None:
    """Deliveries published before the run's last step record are in the run once it reads COMPLETED,
    however far the gateway's reading of them lags behind its reading of the step records."""
    run_id = "drained-run"
    create_run(gateway, run_id)
    epoch = open_trainer_epoch(nats_url, run_id, 0)
    deployments = [f"profile-{i}" for i in range(40)]

    async def publish() -> None:
        bus = await Bus.connect(nats_url, name="test-weight-sync")
        # Many deliveries, then the step records at once: the records finish the run while most
        # deliveries still wait for the gateway to read them.
        await asyncio.gather(
            *(
                bus.publish(
                    subjects.weights(run_id),
                    events_pb2.WeightsPublished(run_id=run_id, version=version, deployment=name, bytes=1),
                    msg_id=f"{run_id}-w-{name}-{version}",
                )
                for version in range(3)
                for name in deployments
            )
        )
        await asyncio.gather(
            *(
                bus.publish(
                    subjects.train(run_id),
                    events_pb2.TrainStepRecord(
                        run_id=run_id, step=step, version=step + 1, num_rollouts=4, trainer_epoch=epoch
                    ),
                    msg_id=f"{run_id}-train-{step}-{epoch}",
                )
                for step in range(3)
            )
        )
        await bus.close()

    asyncio.run(publish())
    final = wait_until(
        lambda: (
            (r := gateway.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=AUTH).run).state
            == gateway_pb2.RUN_STATE_COMPLETED
            and r
        ),
        timeout=30.0,
    )
    delivered = {(w.deployment, w.version) for w in final.weight_syncs}
    assert delivered == {(name, version) for version in range(3) for name in deployments}
