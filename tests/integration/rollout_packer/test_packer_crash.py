"""kill -9 the packer (a real `python -m services.rollout_packer` process) before the trainer
acknowledged a step, restart it: every rollout is trained exactly once, none lost, none twice."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.synthetic_rollouts import make_rollout
from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord
from services.kit.local.infra import free_port, stop_process_group

REPO = Path(__file__).resolve().parents[3]
WORLD = 2
GROUPS_PER_STEP = 4
GROUP_SIZE = 2
STEPS = 4
RECIPE = f"""
[run]
name = "crash"
max_staleness = 100
[batch]
rollouts_per_step = {GROUPS_PER_STEP * GROUP_SIZE}
group_size = {GROUP_SIZE}
max_tokens_per_microbatch = 48
[trainer]
world_size = {WORLD}
"""


class PackerProcess:
    def __init__(self, nats_url: str, log_path: Path) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            "LOOPRL_NATS_URL": nats_url,
            "LOOPRL_PACKER_GRPC_PORT": str(self.port),
            "LOOPRL_PACKER_METRICS_PORT": str(free_port()),
            "LOOPRL_PACKER_ACK_WAIT_S": "2",
            "LOOPRL_PACKER_GRACE_SECONDS": "2",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout_packer"],
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=open(log_path, "ab"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
        )
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = packer_pb2_grpc.RolloutPackerServiceStub(self.channel)

    async def wait_serving(self, run_id: str, timeout: float = 60.0) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            assert self.proc.poll() is None, f"packer exited with {self.proc.returncode}"
            try:
                ok = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if ok.status == health_pb2.HealthCheckResponse.SERVING:
                    # the run arrives through the KV watch shortly after SERVING
                    await self.stub.Stats(packer_pb2.StatsRequest(run_id=run_id), timeout=1.0)
                    return
            except grpc.aio.AioRpcError:
                pass
            assert asyncio.get_running_loop().time() < deadline, "packer did not become ready"
            await asyncio.sleep(0.2)

    async def fetch(self, run_id: str, step: int) -> list[list[list[str]]]:
        """Each rank's micro-batches of the step, as lists of rollout ids."""
        ranks = []
        for rank in range(WORLD):
            req = packer_pb2.NextBatchRequest(
                run_id=run_id,
                step=step,
                rank=rank,
                world_size=WORLD,
                trainer_version=step,
                timeout_seconds=30,
            )
            ranks.append(
                [list(r.micro_batch.rollout_ids) async for r in self.stub.NextBatch(req, timeout=40)]
            )
        return ranks

    async def ack(self, run_id: str, step: int) -> int:
        req = packer_pb2.AckStepRequest(run_id=run_id, step=step, trainer_version=step + 1)
        return (await self.stub.AckStep(req, timeout=10)).acked_rollouts

    async def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        await self.channel.close()

    async def stop(self) -> None:
        await self.channel.close()
        stop_process_group(self.proc, grace=5)


def _ids(batch: list[list[list[str]]]) -> list[str]:
    return [rid for rank in batch for mb in rank for rid in mb]


@pytest.mark.slow
async def test_kill_before_ack_then_restart_trains_every_rollout_exactly_once(nats_url, tmp_path) -> None:
    run_id = f"crash-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="test-crash")
    procs: list[PackerProcess] = []
    try:
        await bus.ensure_streams()
        runs = await bus.kv(subjects.RUNS)
        await runs.put(run_id, RunRecord(run_id, RECIPE, state="running").to_json())
        published = []
        for g in range(STEPS * GROUPS_PER_STEP):
            for i in range(GROUP_SIZE):
                r = make_rollout(
                    f"r{g:02d}-{i}",
                    f"g{g:02d}",
                    run_id=run_id,
                    group_size=GROUP_SIZE,
                    sample_index=i,
                    reward=float(i),
                    completion_len=2 + (g * 7 + i * 5) % 20,
                    seed=g * 10 + i,
                )
                await bus.publish(subjects.rollouts(run_id), r, msg_id=r.rollout_id)
                published.append(r.rollout_id)

        trained: dict[int, list[str]] = {}
        first = PackerProcess(nats_url, tmp_path / "packer-1.log")
        procs.append(first)
        await first.wait_serving(run_id)
        step0 = await first.fetch(run_id, 0)
        assert await first.ack(run_id, 0) == GROUPS_PER_STEP * GROUP_SIZE
        trained[0] = _ids(step0)
        before_crash = await first.fetch(run_id, 1)  # the trainer has the batch, but never acks it
        await first.kill9()

        second = PackerProcess(nats_url, tmp_path / "packer-2.log")
        procs.append(second)
        await second.wait_serving(run_id)
        after_crash = await second.fetch(run_id, 1)
        assert after_crash == before_crash  # the step is rebuilt exactly, rank by rank
        assert await second.ack(run_id, 1) == GROUPS_PER_STEP * GROUP_SIZE
        trained[1] = _ids(after_crash)
        for step in range(2, STEPS):
            trained[step] = _ids(await second.fetch(run_id, step))
            await second.ack(run_id, step)

        counts = collections.Counter(rid for ids in trained.values() for rid in ids)
        assert set(counts) == set(published), "a rollout was lost"
        assert set(counts.values()) == {1}, "a rollout was trained twice"

        # a late re-publish of a trained rollout (outside the dedup window) is recognised and dropped
        again = make_rollout("r00-0", "g00", run_id=run_id, group_size=GROUP_SIZE)
        await bus.publish(subjects.rollouts(run_id), again)
        for _ in range(50):
            stats = await second.stub.Stats(packer_pb2.StatsRequest(run_id=run_id))
            if stats.dropped.get("already_trained"):
                break
            await asyncio.sleep(0.1)
        assert stats.dropped.get("already_trained") == 1
        info = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        for p in procs:
            if p.proc.poll() is None:
                await p.stop()
        await bus.close()
