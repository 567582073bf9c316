"""The event bus against a real nats-server with JetStream (the session's `nats_url`).

Each test uses its own run id (so its own subjects and durables) inside the shared streams,
which ensure_streams provisions idempotently.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer

from looprl.events.v1 import events_pb2
from services.kit.bus import subjects
from services.kit.bus.client import BUS_UNAVAILABLE, Bus, BusError, BusUnavailable, KVConflict, PoisonMessage
from services.kit.bus.consumer import Delivery, batch_process_span, by_producer
from services.kit.local.infra import NatsServer, free_port


def new_run() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, name="test-bus")
    await b.ensure_streams()
    yield b
    await b.close()


async def test_acked_message_is_not_redelivered(bus: Bus) -> None:
    run = new_run()
    task = events_pb2.EpisodeTask(run_id=run, task_id="t-1", group_size=4)
    ack = await bus.publish(subjects.rollouts(run), task, msg_id="t-1", headers={"looprl-kind": "task"})
    assert ack.stream == subjects.ROLLOUTS and not ack.duplicate

    consumer = await bus.pull_consumer(subjects.ROLLOUTS, f"c-{run}", subjects.rollouts(run), ack_wait=1)
    [delivery] = await consumer.fetch(1, timeout=2)
    assert delivery.parse(events_pb2.EpisodeTask) == task
    assert delivery.msg_id == "t-1" and delivery.num_delivered == 1 and delivery.stream_seq == ack.seq
    assert delivery.headers["looprl-kind"] == "task"
    await delivery.ack()
    await delivery.ack()  # a second ack is harmless
    assert delivery.settled == "ack"

    # Wait past ack_wait: an acked message must not come back.
    assert await consumer.fetch(1, timeout=1.3) == []
    info = await consumer.info()
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


async def test_consumer_that_dies_without_ack_gets_redelivered(nats_url: str) -> None:
    run = new_run()
    durable = f"dies-{run}"
    first = await Bus.connect(nats_url, name="doomed")
    await first.ensure_streams()
    await first.publish(subjects.rollouts(run), b"work", msg_id="w-1")
    consumer = await first.pull_consumer(subjects.ROLLOUTS, durable, subjects.rollouts(run), ack_wait=1)
    [taken] = await consumer.fetch(1, timeout=2)
    assert taken.num_delivered == 1
    await first.close()  # the process "dies" holding the message

    second = await Bus.connect(nats_url, name="survivor")
    try:
        consumer = await second.pull_consumer(subjects.ROLLOUTS, durable, subjects.rollouts(run), ack_wait=1)
        [again] = await consumer.fetch(1, timeout=3)
        assert (again.data, again.msg_id, again.stream_seq) == (b"work", "w-1", taken.stream_seq)
        assert again.num_delivered == 2
        await again.ack()
    finally:
        await second.close()


async def test_republished_msg_id_is_deduplicated(bus: Bus) -> None:
    run = new_run()
    subject = subjects.rollouts(run)
    first = await bus.publish(subject, b"rollout", msg_id=f"{run}-r1")
    second = await bus.publish(subject, b"rollout", msg_id=f"{run}-r1")
    assert not first.duplicate
    assert second.duplicate and second.seq == first.seq
    assert await bus.count(subjects.ROLLOUTS, subject) == 1
    # A different id is a different message.
    await bus.publish(subject, b"rollout", msg_id=f"{run}-r2")
    assert await bus.count(subjects.ROLLOUTS, subject) == 2


async def test_term_stops_redelivery_of_a_poison_message(bus: Bus) -> None:
    run = new_run()
    await bus.publish(subjects.rollouts(run), b"\xff\xff not a protobuf", msg_id="p-1")
    durable = f"poison-{run}"
    consumer = await bus.pull_consumer(subjects.ROLLOUTS, durable, subjects.rollouts(run), ack_wait=1)
    advisories = await bus.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ROLLOUTS.{durable}")
    [delivery] = await consumer.fetch(1, timeout=2)
    with pytest.raises(PoisonMessage, match=r"not a valid looprl\.events\.v1\.EpisodeTask"):
        delivery.parse(events_pb2.EpisodeTask)
    await delivery.term("payload does not parse\nas EpisodeTask")
    # The server saw a TERM, with our reason on one line.
    advisory = json.loads((await advisories.next_msg(timeout=2)).data)
    assert advisory["stream_seq"] == delivery.stream_seq
    assert advisory["reason"] == "payload does not parse as EpisodeTask"
    await advisories.unsubscribe()
    assert delivery.settled == "term"
    await delivery.ack()  # settled already: no-op
    assert await consumer.fetch(1, timeout=1.5) == []
    assert (await consumer.info()).num_ack_pending == 0


async def test_nak_redelivers_and_in_progress_holds_the_message(bus: Bus) -> None:
    run = new_run()
    await bus.publish(subjects.rollouts(run), b"slow work")
    consumer = await bus.pull_consumer(subjects.ROLLOUTS, f"slow-{run}", subjects.rollouts(run), ack_wait=1)

    [delivery] = await consumer.fetch(1, timeout=2)
    await delivery.nak()
    [delivery] = await consumer.fetch(1, timeout=2)
    assert delivery.num_delivered == 2

    # Work that outlasts ack_wait keeps the message by reporting progress.
    for _ in range(3):
        await asyncio.sleep(0.5)
        await delivery.in_progress()
    assert await consumer.fetch(1, timeout=0.5) == []
    await delivery.ack()


async def test_close_before_nak_or_a_lingering_pull_swallows_the_redelivery(bus: Bus) -> None:
    """A fetch cut short leaves its pull request on the server until it expires. A nak sent while
    that request still has a subscriber is redelivered straight into it, and the message then sits
    out ack_wait; closing the consumer first removes the interest and the nak redelivers at once."""

    async def hand_back_after_a_cancelled_fetch(close_first: bool) -> float:
        run = new_run()
        await bus.publish(subjects.rollouts(run), b"held work")
        durable = f"handback-{run}"
        consumer = await bus.pull_consumer(subjects.ROLLOUTS, durable, subjects.rollouts(run), ack_wait=2)
        [held] = await consumer.fetch(1, timeout=2)
        cut_short = asyncio.ensure_future(consumer.fetch(8, timeout=3))  # what a stopping intake does
        await asyncio.sleep(0.2)
        cut_short.cancel()
        if close_first:
            await consumer.close()
        await held.nak()
        await asyncio.sleep(0.2)  # the server acts on the nak before it hears of the close
        await consumer.close()
        successor = await bus.pull_consumer(subjects.ROLLOUTS, durable, subjects.rollouts(run), ack_wait=2)
        started = time.monotonic()
        [again] = await successor.fetch(1, timeout=8)
        assert again.stream_seq == held.stream_seq
        await again.ack()
        await successor.close()
        return time.monotonic() - started

    assert await hand_back_after_a_cancelled_fetch(close_first=False) > 1.2
    assert await hand_back_after_a_cancelled_fetch(close_first=True) < 1.0


async def test_ack_all_records_every_ack_once_the_last_is_confirmed(bus: Bus) -> None:
    """A trained step acks thousands of rollouts with one round trip: when ack_all returns, the
    server has recorded all of them (nothing pending, nothing redelivered after ack_wait)."""
    run = new_run()
    for i in range(300):
        await bus.publish(subjects.rollouts(run), f"r{i}".encode(), msg_id=f"{run}-{i}")
    consumer = await bus.pull_consumer(subjects.ROLLOUTS, f"many-{run}", subjects.rollouts(run), ack_wait=1)
    held = []
    while len(held) < 300:
        held += await consumer.fetch(300 - len(held), timeout=2)
    await Delivery.ack_all(held)
    info = await consumer.info()
    assert info.num_ack_pending == 0 and all(d.settled == "ack" for d in held)
    assert await consumer.fetch(1, timeout=1.3) == []  # past ack_wait: none comes back
    other = await bus.pull_consumer(subjects.ROLLOUTS, f"other-{run}", subjects.rollouts(run))
    [theirs] = await other.fetch(1, timeout=2)
    await bus.publish(subjects.rollouts(run), b"late", msg_id=f"{run}-late")
    [mine] = await consumer.fetch(1, timeout=2)
    with pytest.raises(ValueError, match="several consumers"):
        await Delivery.ack_all([mine, theirs])


async def test_max_deliver_bounds_the_attempts(bus: Bus) -> None:
    run = new_run()
    await bus.publish(subjects.rollouts(run), b"flaky")
    consumer = await bus.pull_consumer(
        subjects.ROLLOUTS, f"flaky-{run}", subjects.rollouts(run), ack_wait=5, max_deliver=2
    )
    for attempt in (1, 2):
        [delivery] = await consumer.fetch(1, timeout=2)
        assert delivery.num_delivered == attempt
        await delivery.nak()
    assert await consumer.fetch(1, timeout=0.5) == []


async def traced_bus(nats_url: str) -> tuple[InMemorySpanExporter, Tracer, Bus]:
    """A bus whose spans (and the test's own, from the tracer) are kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return (
        exporter,
        provider.get_tracer("test"),
        await Bus.connect(nats_url, name="traced", tracer_provider=provider),
    )


async def test_trace_context_survives_one_nats_hop(nats_url: str) -> None:
    exporter, tracer, b = await traced_bus(nats_url)
    try:
        await b.ensure_streams()
        run = new_run()
        subject = subjects.train(run)
        with tracer.start_as_current_span("caller"):
            await b.publish(subject, b"step", msg_id="s-1")
        consumer = await b.pull_consumer(subjects.TRAIN, f"tr-{run}", subject)
        [delivery] = await consumer.fetch(1, timeout=2)
        assert "traceparent" in delivery.headers
        with delivery.process_span() as span:
            assert span.is_recording()
        await delivery.ack()
    finally:
        await b.close()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    caller, producer, consumer_span = (
        spans["caller"],
        spans[f"{subject} publish"],
        spans[f"{subject} process"],
    )
    assert producer.kind is SpanKind.PRODUCER and consumer_span.kind is SpanKind.CONSUMER
    assert producer.parent.span_id == caller.context.span_id
    assert consumer_span.context.trace_id == producer.context.trace_id == caller.context.trace_id
    assert consumer_span.parent.span_id == producer.context.span_id
    assert consumer_span.attributes["messaging.message.id"] == "s-1"


async def test_a_batch_publish_is_one_span_and_its_consume_one_span_in_the_same_trace(nats_url: str) -> None:
    exporter, tracer, b = await traced_bus(nats_url)
    try:
        await b.ensure_streams()
        run = new_run()
        subject = subjects.rollouts(run)
        with tracer.start_as_current_span("episode"):
            acks = await b.publish_batch(subject, [(b"r0", "r-0"), (b"r1", "r-1"), (b"r2", "r-2")])
            again = await b.publish_batch(subject, [(b"r1", "r-1")])  # ids deduplicate as with publish
        assert len({a.seq for a in acks}) == 3 and again[0].duplicate
        with tracer.start_as_current_span("other episode"):
            await b.publish(subject, b"r3", msg_id="r-3")
        consumer = await b.pull_consumer(subjects.ROLLOUTS, f"batch-{run}", subject)
        deliveries = await consumer.fetch(10, timeout=2)
        assert sorted(d.data for d in deliveries) == [b"r0", b"r1", b"r2", b"r3"]
        batches = by_producer(deliveries)
        assert [sorted(d.msg_id for d in batch) for batch in batches] == [["r-0", "r-1", "r-2"], ["r-3"]]
        for batch in batches:
            with batch_process_span(batch):
                for d in batch:
                    await d.ack()
    finally:
        await b.close()

    spans = exporter.get_finished_spans()
    publishes = [s for s in spans if s.name == f"{subject} publish"]
    processes = [s for s in spans if s.name == f"{subject} process"]
    assert len(publishes) == 3 and len(processes) == 2  # the duplicate publish is a span of its own
    first = publishes[0]
    assert first.attributes["messaging.batch.message_count"] == 3
    assert first.attributes["messaging.message.id"] == "r-0,r-1,r-2"  # in the order given
    assert publishes[1].attributes["messaging.nats.duplicate"] is True
    for process, publish in zip(processes, (first, publishes[2]), strict=True):
        assert process.parent.span_id == publish.context.span_id
        assert process.context.trace_id == publish.context.trace_id
    assert processes[0].attributes["messaging.batch.message_count"] == 3


async def test_work_that_starts_its_own_trace_links_to_the_publish(nats_url: str) -> None:
    exporter, tracer, b = await traced_bus(nats_url)
    try:
        await b.ensure_streams()
        run = new_run()
        subject = subjects.episodes(run)
        with tracer.start_as_current_span("feed"):
            await b.publish(subject, b"task", msg_id="t-1")
        consumer = await b.pull_consumer(subjects.EPISODES, f"ep-{run}", subject)
        [delivery] = await consumer.fetch(1, timeout=2)
        with delivery.process_span("episode", new_trace=True, attributes={"looprl.run_id": run}):
            pass
        await delivery.ack()
    finally:
        await b.close()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    producer, episode = spans[f"{subject} publish"], spans["episode"]
    assert episode.parent is None and episode.context.trace_id != producer.context.trace_id
    assert [link.context.span_id for link in episode.links] == [producer.context.span_id]
    assert episode.attributes["looprl.run_id"] == run


async def test_work_queue_message_acked_by_one_worker_is_gone(nats_url: str) -> None:
    run = new_run()
    subject = subjects.episodes(run)
    durable = f"workers-{run}"
    a = await Bus.connect(nats_url, name="worker-a")
    b = await Bus.connect(nats_url, name="worker-b")
    try:
        await a.ensure_streams()
        for i in range(2):
            await a.publish(
                subject, events_pb2.EpisodeTask(run_id=run, task_id=f"e{i}"), msg_id=f"{run}-e{i}"
            )
        assert await a.count(subjects.EPISODES, subject) == 2
        worker_a = await a.pull_consumer(subjects.EPISODES, durable, subject)
        worker_b = await b.pull_consumer(subjects.EPISODES, durable, subject)

        [da] = await worker_a.fetch(1, timeout=2)
        await da.ack()
        assert await a.count(subjects.EPISODES, subject) == 1  # acked work leaves the queue
        [db] = await worker_b.fetch(5, timeout=1)
        assert db.parse(events_pb2.EpisodeTask).task_id != da.parse(events_pb2.EpisodeTask).task_id
        await db.ack()
        assert await a.count(subjects.EPISODES, subject) == 0
        assert await worker_a.fetch(1, timeout=0.3) == []
    finally:
        await a.close()
        await b.close()


async def test_work_queue_refuses_a_second_overlapping_consumer(bus: Bus) -> None:
    run = new_run()
    await bus.pull_consumer(subjects.EPISODES, f"one-{run}", subjects.episodes(run))
    with pytest.raises(BusError, match=f"cannot create consumer two-{run} on stream EPISODES"):
        await bus.pull_consumer(subjects.EPISODES, f"two-{run}", subjects.episodes(run))
    assert await bus.delete_consumer(subjects.EPISODES, f"one-{run}")


async def test_kv_compare_and_set(bus: Bus) -> None:
    kv = await bus.kv(subjects.RUNS)
    key = new_run()
    assert await kv.get(key) is None
    rev1 = await kv.create(key, b"created")
    with pytest.raises(KVConflict):
        await kv.create(key, b"again")
    rev2 = await kv.update(key, b"running", last_revision=rev1)
    assert rev2 > rev1

    with pytest.raises(KVConflict) as conflict:
        await kv.update(key, b"stale writer", last_revision=rev1)
    message = str(conflict.value)
    assert key in message and f"expected revision {rev1}" in message and f"at revision {rev2}" in message
    assert await kv.get(key) == b"running"
    assert (await kv.entry(key)).revision == rev2
    assert key in await kv.items()

    await kv.delete(key)
    assert await kv.get(key) is None
    assert key not in await kv.items()
    with pytest.raises(ValueError, match="KV key"):
        await kv.get("bad key")


async def test_kv_items_lists_each_key_once_while_keys_are_rewritten(bus: Bus) -> None:
    # What a gateway sees listing the runs while their drivers rewrite the records: every run once.
    kv = await bus.kv(subjects.RUNS)
    keys = [new_run() for _ in range(20)]
    for key in keys:
        await kv.put(key, b"0")
    await kv.put(f"{keys[0]}.history.0", b"chunk")  # not a run: '*' is one token

    async def rewrite() -> None:
        for n in range(200):
            await kv.put(keys[n % len(keys)], str(n).encode())

    writer = asyncio.create_task(rewrite())
    try:
        while not writer.done():
            listed = await kv.items("*")
            assert [k for k in listed if k in keys] == sorted(keys)
    finally:
        await writer
    for key in keys:
        await kv.delete(key)


async def test_kv_watch_sees_current_values_then_changes(bus: Bus) -> None:
    kv = await bus.kv(subjects.DEPLOYMENTS)
    prefix = new_run()
    await kv.put(f"{prefix}.a", b"1")
    async with kv.watch(f"{prefix}.>") as watch:
        first = await asyncio.wait_for(anext(watch), 2)
        assert (first.key, first.value) == (f"{prefix}.a", b"1")
        await kv.put(f"{prefix}.b", b"2")
        await kv.delete(f"{prefix}.a")
        second = await asyncio.wait_for(anext(watch), 2)
        third = await asyncio.wait_for(anext(watch), 2)
    assert (second.key, second.value, second.deleted) == (f"{prefix}.b", b"2", False)
    assert (third.key, third.deleted) == (f"{prefix}.a", True)


async def test_ensure_streams_is_idempotent(bus: Bus) -> None:
    await bus.ensure_streams()
    await bus.ensure_streams()
    info = await bus.js.stream_info(subjects.EPISODES)
    assert info.config.retention == "workqueue"
    assert info.config.subjects == ["looprl.*.episodes"]
    assert info.config.duplicate_window == pytest.approx(120)
    assert info.config.storage == "file"
    assert (await bus.js.stream_info(subjects.ROLLOUTS)).config.retention == "limits"


async def test_ensure_streams_updates_a_drifted_stream_and_refuses_a_retention_change(bus: Bus) -> None:
    name = f"T{uuid.uuid4().hex[:10].upper()}"
    spec = subjects.StreamSpec(name, (f"looprl-test.{name}.>",), subjects.Retention.LIMITS)
    try:
        await bus.ensure_streams([spec], [], duplicate_window_s=30)
        assert (await bus.js.stream_info(name)).config.duplicate_window == pytest.approx(30)
        await bus.ensure_streams([spec], [], duplicate_window_s=60)
        assert (await bus.js.stream_info(name)).config.duplicate_window == pytest.approx(60)

        as_queue = subjects.StreamSpec(name, spec.subjects, subjects.Retention.WORK_QUEUE)
        with pytest.raises(BusError, match=f"stream {name} exists with retention limits but workqueue"):
            await bus.ensure_streams([as_queue], [])
    finally:
        await bus.js.delete_stream(name)


async def test_concurrent_provisioning_from_several_services(nats_url: str) -> None:
    name = f"T{uuid.uuid4().hex[:10].upper()}"
    spec = subjects.StreamSpec(name, (f"looprl-test.{name}.>",), subjects.Retention.WORK_QUEUE)
    bucket = subjects.BucketSpec(f"b{uuid.uuid4().hex[:10]}", history=3)
    buses = [await Bus.connect(nats_url, name=f"svc-{i}") for i in range(3)]
    try:
        await asyncio.gather(*(b.ensure_streams([spec], [bucket]) for b in buses))
        assert (await buses[0].js.stream_info(name)).config.retention == "workqueue"
        assert await (await buses[1].kv(bucket.name)).put("k", b"v") > 0
    finally:
        await buses[0].js.delete_stream(name)
        await buses[0].js.delete_key_value(bucket.name)
        for b in buses:
            await b.close()


async def test_a_retried_publish_outlasts_a_frozen_server_and_is_stored_once(tmp_path) -> None:
    """A server that answers nothing for longer than a publish's timeout (frozen, or restarting)
    costs a retried publish nothing: it lands once the server is back, and the attempt that timed
    out but reached the stream is a duplicate, not a second message."""
    server = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    bus = await Bus.connect(server.url, name="test-retry")
    try:
        await bus.ensure_streams()
        run = new_run()
        subject = subjects.train(run)
        os.kill(server.proc.pid, signal.SIGSTOP)
        publishing = asyncio.create_task(
            bus.publish_retrying(subject, b"step 0", msg_id=f"{run}-train-0", within_s=30, timeout_s=0.5)
        )
        # Meanwhile several attempts time out, and a publish retried for less time gives up with
        # the bus's error, not a hang and not a silent loss.
        started = time.monotonic()
        with pytest.raises(BUS_UNAVAILABLE):
            await bus.publish_retrying(
                subjects.train(new_run()), b"given up", msg_id="given-up", within_s=1.0, timeout_s=0.5
            )
        assert time.monotonic() - started < 5
        assert not publishing.done()
        os.kill(server.proc.pid, signal.SIGCONT)
        ack = await asyncio.wait_for(publishing, timeout=30)
        assert ack.stream == subjects.TRAIN
        assert await bus.count(subjects.TRAIN, subject) == 1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await bus.close()
        server.stop()


async def test_a_retried_publish_refuses_settings_that_could_store_twice(bus: Bus) -> None:
    with pytest.raises(ValueError, match="msg_id"):
        await bus.publish_retrying(subjects.train(new_run()), b"x", msg_id="", within_s=5)
    with pytest.raises(ValueError, match="within_s"):
        await bus.publish_retrying(subjects.train(new_run()), b"x", msg_id="m", within_s=600)


async def test_publish_without_a_stream_is_a_clear_error(bus: Bus) -> None:
    with pytest.raises(BusError, match=r"no JetStream stream stores subject 'nowhere\.at\.all'"):
        await bus.publish("nowhere.at.all", b"x")


async def test_missing_server_is_a_clear_error_not_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(BusUnavailable, match=r"cannot reach NATS at nats://127\.0\.0\.1:"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", name="nobody", connect_timeout_s=1)
    assert time.monotonic() - start < 5


async def test_bad_consumer_settings_are_rejected(bus: Bus) -> None:
    with pytest.raises(ValueError, match="consumer name"):
        await bus.pull_consumer(subjects.ROLLOUTS, "has.dot", subjects.rollouts("r"))
    with pytest.raises(ValueError, match="max_deliver"):
        await bus.pull_consumer(
            subjects.ROLLOUTS, "ok", subjects.rollouts("r"), max_deliver=2, backoff=[1, 2]
        )
    with pytest.raises(BusError, match="stream NOPE does not exist"):
        await bus.pull_consumer("NOPE", "ok", subjects.rollouts("r"))


async def test_a_follower_cancelled_mid_fetch_does_not_hold_up_drain(nats_url: str) -> None:
    """`looprl down` after a run waited out the gateway's whole grace period: its run followers,
    cancelled in the middle of a fetch, left their subscriptions for the connection's drain to wait on."""
    run = new_run()
    bus = await Bus.connect(nats_url, name="test-drain")
    await bus.ensure_streams()
    await bus.publish(subjects.events(run), events_pb2.RunError(run_id=run, message="m"), msg_id=f"{run}-0")

    async def follow() -> None:
        async with await bus.pull_consumer(subjects.RUN_EVENTS, f"d-{run}", subjects.events(run)) as consumer:
            while True:
                await consumer.fetch(64, timeout=1.0)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(1.5)  # past the first fetch, inside the next one
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follower
    started = time.monotonic()
    await asyncio.wait_for(bus.drain(), timeout=20)
    assert time.monotonic() - started < 5, "the drain waited on the cancelled follower's subscription"


async def test_a_consumer_still_open_when_the_bus_drains_does_not_hold_up_the_drain(nats_url: str) -> None:
    """A service's shutdown drains its bus while followers it cancelled have not yet unwound (the
    gateway's run followers did: `looprl down` then waited out its grace period). A pull consumer
    left open is closed by the drain; what it held unacked is redelivered."""
    run = new_run()
    bus = await Bus.connect(nats_url, name="test-drain-open")
    await bus.ensure_streams()
    durable = f"o-{run}"
    consumer = await bus.pull_consumer(subjects.RUN_EVENTS, durable, subjects.events(run), ack_wait=1.0)
    fetching = asyncio.create_task(consumer.fetch(1, timeout=2.0))
    await asyncio.sleep(0.2)
    fetching.cancel()  # its pull request stays on the server, and the next message goes to it
    await bus.publish(subjects.events(run), events_pb2.RunError(run_id=run, message="m"), msg_id=f"{run}-0")
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await asyncio.wait_for(bus.drain(), timeout=20)
    assert time.monotonic() - started < 5, "the drain waited on a consumer's undelivered messages"
    again = await Bus.connect(nats_url, name="test-drain-again")
    try:
        retry = await again.pull_consumer(subjects.RUN_EVENTS, durable, subjects.events(run), ack_wait=1.0)
        deadline = time.monotonic() + 10
        got: list[Delivery] = []
        while not got and time.monotonic() < deadline:
            got = await retry.fetch(1, timeout=1.0)
        assert [d.parse(events_pb2.RunError).message for d in got] == ["m"]
        await got[0].ack()
    finally:
        await again.close()
