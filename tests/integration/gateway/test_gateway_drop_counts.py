"""A run's driver takes the packer's drop counts at most once a DROPPED_REFRESH_S, and fresh when
the run completes (so a completed run's accounting is exact), from a real packer."""

from __future__ import annotations

import asyncio
import uuid

import grpc

from gateway.runs import RunDriver
from looprl.common.v1 import common_pb2
from looprl.packer.v1 import packer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.messages import rollouts as rollout_messages
from services.rollout_packer.step import PackerSettings
from tests.support.packer import running_packer


async def test_drop_counts_are_asked_for_at_most_once_a_second_and_fresh_on_demand(nats_url) -> None:
    run_id = f"drops-{uuid.uuid4().hex[:8]}"
    async with running_packer(nats_url) as (app, service):
        await app.add_run(run_id, PackerSettings(prompts_per_step=2, group_size=2, world_size=1))
        channel = grpc.aio.insecure_channel(service.address)
        bus = await Bus.connect(nats_url, name="test-publisher")
        try:
            driver = RunDriver(bus, None, run_id, packer_pb2_grpc.RolloutPackerServiceStub(channel))  # type: ignore[arg-type]

            async def drop_one() -> None:
                empty = common_pb2.RolloutGroup()  # a group without rollouts: dropped as malformed
                await bus.publish(subjects.rollouts(run_id), empty, headers=rollout_messages.GROUP_HEADERS)

            async def malformed(fresh: bool = False) -> int | None:
                counts = await driver._dropped(fresh=fresh)
                return None if counts is None else counts.get("malformed", 0)

            await drop_one()
            for _ in range(100):  # until the packer took it in
                if await malformed(fresh=True) == 1:
                    break
                await asyncio.sleep(0.05)
            await drop_one()
            await asyncio.sleep(0.3)
            assert await malformed() is None  # asked a moment ago: the record keeps what it has
            assert await malformed(fresh=True) == 2
        finally:
            await bus.close()
            await channel.close()
