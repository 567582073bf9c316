"""A step's rollouts over the bus: one RolloutGroup message per group against one message per rollout.

The default recipe's step on a real nats-server: 8 groups of 8 rollouts published concurrently the
way environment-sandbox publishes them (`Bus.publish_batch`, message ids, JetStream acks), pulled
by a durable consumer, decoded (`rollout_messages.rollouts_in`) and acked the way the packer does
(`Delivery.ack_all`). The baseline publishes each rollout as its own message, as the sandbox did
before RolloutGroup. Figures: CPU per step (this process, publisher and consumer both, plus the
nats-server) and wall time per step, grouped against per rollout.

    python -m bench.rollout_messages [--quick]
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.common import emit, parse_args
from looprl.common.v1 import common_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.bus.consumer import Delivery
from services.kit.local.infra import NatsServer, free_port
from services.kit.messages import rollouts as rollout_messages

BENCH = "rollout_messages"
GROUPS, GROUP_SIZE = 8, 8
RUN = "bench"


def _rollout(group: str, i: int) -> common_pb2.Rollout:
    prompt = common_pb2.Turn(role=common_pb2.ROLE_USER, token_ids=list(range(24)))
    answer = common_pb2.Turn(
        role=common_pb2.ROLE_ASSISTANT, token_ids=[5, 6, 7, 3], logprobs=[-0.5] * 4, trainable=True
    )
    return common_pb2.Rollout(
        rollout_id=f"{group}-{i}",
        run_id=RUN,
        group_id=group,
        turns=[prompt, answer],
        reward=0.5,
        group_size=GROUP_SIZE,
        sample_index=i,
    )


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(grouped: bool, steps: int, warmup: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per step, after `warmup` steps."""
    with tempfile.TemporaryDirectory(prefix="looprl-bench-bus-") as state:
        server = NatsServer(Path(state), port=free_port()).start()
        try:
            publisher = await Bus.connect(server.url, name="bench-sandbox")
            consumer_bus = await Bus.connect(server.url, name="bench-packer")
            await publisher.ensure_streams()
            subject = subjects.rollouts(RUN)
            consumer = await consumer_bus.pull_consumer(
                subjects.ROLLOUTS, "packer-bench", subject, ack_wait=30, max_deliver=-1, max_ack_pending=65536
            )

            async def publish(step: int, group: int) -> None:
                rollouts = [_rollout(f"s{step}-g{group}", i) for i in range(GROUP_SIZE)]
                if grouped:
                    messages = rollout_messages.group_messages(rollouts, publisher.nc.max_payload)
                    await publisher.publish_batch(subject, messages, rollout_messages.GROUP_HEADERS)
                else:
                    await publisher.publish_batch(subject, [(r, r.rollout_id) for r in rollouts])

            async def consume() -> None:
                deliveries, taken = [], 0
                while taken < GROUPS * GROUP_SIZE:
                    batch = await consumer.fetch(256, timeout=5.0)
                    deliveries += batch
                    taken += sum(len(rollout_messages.rollouts_in(d)) for d in batch)
                await Delivery.ack_all(deliveries)

            async def step(s: int) -> None:
                await asyncio.gather(*(publish(s, g) for g in range(GROUPS)), consume())

            for s in range(warmup):
                await step(s)
            cpu0, nats0, wall0 = time.process_time(), _process_cpu_s(server.proc.pid), time.perf_counter()
            for s in range(warmup, warmup + steps):
                await step(s)
            wall = time.perf_counter() - wall0
            cpu = time.process_time() - cpu0 + _process_cpu_s(server.proc.pid) - nats0
            await publisher.close()
            await consumer_bus.close()
        finally:
            server.stop()
    return 1000 * cpu / steps, 1000 * wall / steps


async def run(quick: bool) -> None:
    steps, warmup = (40, 10) if quick else (300, 30)
    per_rollout = await _measure(False, steps, warmup)
    grouped = await _measure(True, steps, warmup)
    print(
        f"{GROUPS} groups of {GROUP_SIZE} per step, {steps} steps: per rollout {per_rollout[0]:.2f} ms CPU, "
        f"{per_rollout[1]:.2f} ms wall; grouped {grouped[0]:.2f} ms CPU, {grouped[1]:.2f} ms wall"
    )
    for figure, index in (("cpu_ms_per_step", 0), ("wall_ms_per_step", 1)):
        emit(
            BENCH,
            figure,
            grouped[index],
            per_rollout[index],
            grouped[index] / per_rollout[index],
            "ms per step of 64 rollouts (baseline: one message per rollout; CPU: both ends and nats-server)",
            "ratio <= 0.5",
        )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    asyncio.run(run(args.quick))


if __name__ == "__main__":
    main()
