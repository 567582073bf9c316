"""Weight-sync's events on a real nats-server: a delivered version is announced once, even when the
server stops answering while weight-sync announces it."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

from looprl.events.v1 import events_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.local.infra import NatsServer, free_port
from services.weight_sync.state import StateStore
from services.weight_sync.targets import target_from_request


async def test_a_delivered_version_is_announced_once_across_a_frozen_server(tmp_path) -> None:
    server = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    bus = await Bus.connect(server.url, name="test-weightsync-state")
    try:
        await bus.ensure_streams()
        run = f"r{uuid.uuid4().hex[:8]}"
        state = StateStore(bus, await bus.kv(subjects.WEIGHTS_KV), run)
        target = target_from_request(
            weightsync_pb2.RegisterTargetRequest(
                deployment="short-r0",
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf"),
                ranks=[weightsync_pb2.TargetRank(rank=0, address="127.0.0.1:1")],
            )
        )
        os.kill(server.proc.pid, signal.SIGSTOP)
        announcing = asyncio.create_task(state.published(target, run, 7, nbytes=1024, seconds=0.01))
        # Longer than one publish's timeout (5 s): the first attempt times out and is retried.
        await asyncio.sleep(6.0)
        assert not announcing.done()
        os.kill(server.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(announcing, timeout=30)

        assert await bus.count(subjects.WEIGHTS, subjects.weights(run)) == 1
        consumer = await bus.pull_consumer(subjects.WEIGHTS, f"t-{run}", subjects.weights(run))
        async with consumer:
            (delivery,) = await consumer.fetch(batch=2, timeout=2.0)
            event = delivery.parse(events_pb2.WeightsPublished)
        assert (event.run_id, event.deployment, event.version, event.bytes) == (run, "short-r0", 7, 1024)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await bus.close()
        server.stop()
