"""A crashed episode worker: its task is redelivered and finished once; the rollout reaches the
stream exactly once (same rollout id -> JetStream dedup). Real nats-server, real worker processes
killed mid-task (after publishing, before acking: the worst moment)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from looprl.events.v1 import events_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.local.infra import NatsServer, free_port
from services.kit.messages import rollouts as rollout_messages

pytestmark = pytest.mark.slow

CHILD = r"""
import asyncio, re, sys
from services.environment_sandbox.episode_worker import EpisodeWorker, WorkerConfig
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.modeling.tokenizer import CharTokenizer

tok = CharTokenizer()

async def reverse_policy(prompt_ids, sampling, session_id, min_weight_version):
    # A stand-in policy that always answers right, so the test checks delivery, not learning.
    digits = re.findall(r"rev (\d+)", tok.decode(prompt_ids))[-1]
    ids = [*tok.encode(digits[::-1]), tok.eos_token_id]
    return ModelTurn(ids, [-0.1] * len(ids), "stop", 1)

async def main(url, run, durable):
    bus = await Bus.connect(url, name="worker")
    runner = EpisodeRunner(OneAtATime(reverse_policy), None, tok)
    worker = EpisodeWorker(bus, runner, WorkerConfig(concurrency=1, durable=durable, ack_wait_s=1.0),
                           filter_subject=subjects.episodes(run))
    await worker.run()

asyncio.run(main(*sys.argv[1:4]))
"""


async def test_crashed_worker_task_is_redelivered_and_published_once(tmp_path):
    nats = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    procs: list[subprocess.Popen] = []
    try:
        bus = await Bus.connect(nats.url, name="test")
        await bus.ensure_streams()
        run = "crash1"
        for i in range(3):
            task = events_pb2.EpisodeTask(
                run_id=run,
                task_id=f"t{i}",
                group_id=f"g{i}",
                environment="digits",
                task_json=f'{{"digits": "{100 + i}"}}',
                group_size=1,
            )
            await bus.publish(subjects.episodes(run), task, msg_id=f"{run}-t{i}")

        def spawn(crash: bool) -> subprocess.Popen:
            env = {**os.environ, "LOOPRL_TEST_CRASH_AFTER_PUBLISH": "1" if crash else "0"}
            proc = subprocess.Popen([sys.executable, "-c", CHILD, nats.url, run, "ep-workers"], env=env)
            procs.append(proc)
            return proc

        crashing = spawn(crash=True)
        deadline = time.monotonic() + 20
        while crashing.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert crashing.returncode == 17  # died after publishing, before acking
        assert await bus.count(subjects.ROLLOUTS, subjects.rollouts(run)) == 1

        spawn(crash=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if await bus.count(subjects.EPISODES, subjects.episodes(run)) == 0:
                break
            await asyncio.sleep(0.2)
        assert await bus.count(subjects.EPISODES, subjects.episodes(run)) == 0  # every task acked
        consumer = await bus.pull_consumer(subjects.ROLLOUTS, "check", subjects.rollouts(run))
        deliveries = await consumer.fetch(batch=10, timeout=1.0)
        rollouts = [r for d in deliveries for r in rollout_messages.rollouts_in(d)]
        assert sorted(r.task_id for r in rollouts) == ["t0", "t1", "t2"]  # each exactly once
        assert len({r.rollout_id for r in rollouts}) == 3
        assert all(r.reward == pytest.approx(1.0) for r in rollouts)
        await bus.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        nats.stop()
