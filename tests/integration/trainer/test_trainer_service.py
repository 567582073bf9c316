"""The trainer service end to end against the real rollout-packer, a real nats-server and the
session's Ray head: pulls packed steps, trains 2 ranks, publishes step records, checkpoints, acks,
and a restarted trainer resumes from its last checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import grpc
import pytest

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import parse_recipe
from services.kit.local.infra import free_port
from services.kit.rpc.server import Service
from services.trainer.checkpoint import list_checkpoints
from services.trainer.config import TrainerConfig
from services.trainer.runs import TrainerApp
from services.trainer.servicer import TrainerServicer
from tests.support.packer import running_packer

pytestmark = pytest.mark.slow

RECIPE = """
[run]
name = "trainer-svc"
steps = {steps}
max_staleness = 8
[model]
preset = "tiny-qwen2"
[batch]
rollouts_per_step = 4
group_size = 2
max_tokens_per_microbatch = 48
[optimizer]
lr = 0.001
[trainer]
world_size = 2
checkpoint_every = 2
"""


def _rollout(run_id: str, gid: str, i: int, seed: int) -> common_pb2.Rollout:
    prompt = [1 + (seed * 7 + k) % 90 for k in range(3 + seed % 3)]
    completion = [1 + (seed * 13 + k * 5) % 90 for k in range(2 + (seed + i) % 5)]
    return common_pb2.Rollout(
        rollout_id=f"{gid}-{i}",
        run_id=run_id,
        group_id=gid,
        task_id=gid,
        environment="digits",
        group_size=2,
        sample_index=i,
        reward=float(i),
        turns=[
            common_pb2.Turn(role=common_pb2.ROLE_USER, token_ids=prompt),
            common_pb2.Turn(
                role=common_pb2.ROLE_ASSISTANT,
                token_ids=completion,
                logprobs=[-4.6] * len(completion),
                trainable=True,
                weight_version=0,
            ),
        ],
    )


async def _publish_steps(bus: Bus, run_id: str, first: int, count: int) -> None:
    for step in range(first, first + count):
        for g in range(2):
            gid = f"s{step}g{g}"
            for i in range(2):
                await bus.publish(subjects.rollouts(run_id), _rollout(run_id, gid, i, step * 2 + g))


@pytest.fixture
async def packer(nats_url):
    async with running_packer(nats_url) as (app, service):
        yield app, service.address


async def _trainer(
    nats_url: str, packer_address: str, checkpoint_dir: str, weight_sync_address: str = "", **settings
):
    cfg = TrainerConfig(
        nats_url=nats_url,
        grpc_port=free_port(),
        metrics_port=free_port(),
        packer_address=packer_address,
        watch_runs=False,
        checkpoint_dir=checkpoint_dir,
        next_batch_timeout_s=2.0,
        grace_seconds=60.0,
        weight_sync_address=weight_sync_address,
        **settings,
    )
    app = TrainerApp(cfg)
    service = Service("trainer", cfg)
    service.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(app))
    service.on_shutdown(app.stop)
    await service.start()
    await app.start()
    await service.mark_ready()
    return app, service


async def _started(packer, nats_url: str, tmp_path, steps: int):
    """A fresh run of RECIPE registered with the packer, a bus client and a started trainer service."""
    packer_app, packer_address = packer
    run_id = f"tr-{uuid.uuid4().hex[:8]}"
    recipe = parse_recipe(RECIPE.format(steps=steps))
    await packer_app.add_run(run_id, packer_app.settings_for(recipe))
    bus = await Bus.connect(nats_url, name="test")
    app, service = await _trainer(nats_url, packer_address, str(tmp_path))
    return run_id, recipe, bus, app, service


async def test_trainer_service_trains_checkpoints_acks_and_resumes(
    packer, nats_url, ray_client, tmp_path
) -> None:
    run_id, recipe, bus, app, service = await _started(packer, nats_url, tmp_path, steps=3)
    packer_address = packer[1]
    channel = grpc.aio.insecure_channel(service.address)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    try:
        status = await stub.Status(trainer_pb2.StatusRequest())
        assert status.state == "idle"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Checkpoint(trainer_pb2.CheckpointRequest())
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        await _publish_steps(bus, run_id, 0, 3)
        app.begin(run_id, recipe)
        await asyncio.wait_for(app.wait(), timeout=120)

        status = await stub.Status(trainer_pb2.StatusRequest())
        assert (status.state, status.step, status.weight_version, status.world_size) == (
            "completed",
            3,
            3,
            2,
        ), status
        assert status.last_checkpoint.endswith("step_00000003")
        config = json.loads((await stub.GetConfig(trainer_pb2.GetConfigRequest())).config_json)
        assert config["run"]["spec"]["optimizer"]["lr"] == 0.001

        run_dir = tmp_path / run_id
        assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000002", "step_00000003"]
        assert (run_dir / "hf" / "step_00000003" / "model.safetensors").exists()

        records = await _train_records(bus, run_id, 3)
        assert [r.step for r in records] == [0, 1, 2] and [r.version for r in records] == [1, 2, 3]
        assert all(r.num_rollouts == 4 and r.num_tokens > 0 and r.grad_norm > 0 for r in records)
        assert sorted(rid for r in records for rid in r.rollout_ids) == sorted(
            f"s{s}g{g}-{i}" for s in range(3) for g in range(2) for i in range(2)
        )
        packer_stub = packer_pb2_grpc.RolloutPackerServiceStub(grpc.aio.insecure_channel(packer_address))
        stats = await packer_stub.Stats(packer_pb2.StatsRequest(run_id=run_id))
        assert stats.acked_rollouts == 12  # every step acknowledged once its checkpoint existed

        # A new trainer for the same run, with two more steps: resumes from step 3, not from scratch.
        await _publish_steps(bus, run_id, 3, 2)
        app.begin(run_id, parse_recipe(RECIPE.format(steps=5)))
        await asyncio.wait_for(app.wait(), timeout=120)
        status = await stub.Status(trainer_pb2.StatusRequest())
        assert (status.state, status.step) == ("completed", 5), status
        records = await _train_records(bus, run_id, 5)
        assert [r.step for r in records] == [0, 1, 2, 3, 4]
    finally:
        await channel.close()
        await service.drain()
        await bus.close()


async def test_a_weight_push_that_keeps_failing_is_retried_then_fails_the_run_with_the_reason(
    packer, nats_url, ray_client, tmp_path
) -> None:
    packer_app, packer_address = packer
    run_id = f"tr-{uuid.uuid4().hex[:8]}"
    recipe = parse_recipe(RECIPE.format(steps=2))
    await packer_app.add_run(run_id, packer_app.settings_for(recipe))
    bus = await Bus.connect(nats_url, name="test")
    sub = await bus.js.subscribe(subjects.events(run_id), ordered_consumer=True)
    # Nothing listens at weight-sync's address: the first push (version 0, before any step) fails,
    # and so does every retry within push_retry_s.
    address = f"127.0.0.1:{free_port()}"
    app, service = await _trainer(nats_url, packer_address, str(tmp_path), address, push_retry_s=3.0)
    try:
        app.begin(run_id, recipe)
        await asyncio.wait_for(app.wait(), timeout=120)
        assert app.run.state == "failed"
        retrying = events_pb2.RunError.FromString((await sub.next_msg(timeout=30)).data)
        assert (retrying.run_id, retrying.component, retrying.fatal) == (run_id, "trainer", False)
        assert retrying.message.startswith(
            f"pushing version 0 failed, retrying: PushShards to weight-sync at {address}"
        )
        gave_up = events_pb2.RunError.FromString((await sub.next_msg(timeout=30)).data)
        assert gave_up.fatal, "the give-up is fatal: the gateway fails the run with it"
        assert gave_up.message.startswith(
            "training failed at step 0: RuntimeError: pushing version 0 to weight-sync "
        )
        assert "times over 3s (trainer push_retry_s): PushShards" in gave_up.message
        assert ": UNAVAILABLE: failed to connect" in gave_up.message
    finally:
        await sub.unsubscribe()
        await service.drain()
        await bus.close()


async def _train_records(bus: Bus, run_id: str, expected: int) -> list[events_pb2.TrainStepRecord]:
    sub = await bus.js.subscribe(subjects.train(run_id), ordered_consumer=True)
    out = []
    try:
        while len(out) < expected:
            msg = await sub.next_msg(timeout=60)  # the first waits for the ranks to start
            out.append(events_pb2.TrainStepRecord.FromString(msg.data))
    finally:
        await sub.unsubscribe()
    return out


async def test_sigterm_drain_finishes_the_step_and_writes_a_final_checkpoint(
    packer, nats_url, ray_client, tmp_path
) -> None:
    run_id, recipe, bus, app, service = await _started(packer, nats_url, tmp_path, steps=50)
    packer_address = packer[1]
    try:
        await _publish_steps(bus, run_id, 0, 1)  # one step of data, then the trainer waits for more
        run = app.begin(run_id, recipe)
        await _train_records(bus, run_id, 1)
        await service.drain()  # what SIGTERM triggers: stop after the step, checkpoint, release ranks
        assert run.state == "stopped" and run.step == 1
        assert [p.name for p in list_checkpoints(tmp_path / run_id)] == ["step_00000001"]
        stats = await packer_pb2_grpc.RolloutPackerServiceStub(
            grpc.aio.insecure_channel(packer_address)
        ).Stats(packer_pb2.StatsRequest(run_id=run_id))
        assert stats.acked_rollouts == 4  # acked once the final checkpoint covered it
    finally:
        await service.drain()
        await bus.close()


async def test_a_periodic_checkpoint_acknowledges_only_the_steps_it_covers(
    packer, nats_url, ray_client, tmp_path
) -> None:
    """The checkpoint after step 1 covers steps 0 and 1. They are acknowledged while step 2 trains
    (in the background); step 2 stays unacknowledged (a crash would retrain it) until the final
    checkpoint covers it."""
    run_id, recipe, bus, app, service = await _started(packer, nats_url, tmp_path, steps=50)
    packer_address = packer[1]
    packer_stub = packer_pb2_grpc.RolloutPackerServiceStub(grpc.aio.insecure_channel(packer_address))

    async def acked() -> int:
        return (await packer_stub.Stats(packer_pb2.StatsRequest(run_id=run_id))).acked_rollouts

    try:
        await _publish_steps(bus, run_id, 0, 3)  # three steps of data, then the trainer waits for more
        run = app.begin(run_id, recipe)
        await _train_records(bus, run_id, 3)
        for _ in range(100):
            if await acked() == 8:
                break
            await asyncio.sleep(0.1)
        assert await acked() == 8 and run.step == 3  # steps 0 and 1, not step 2
        assert [p.name for p in list_checkpoints(tmp_path / run_id)] == ["step_00000002"]
        await service.drain()
        assert run.state == "stopped" and await acked() == 12  # the final checkpoint covers step 2
    finally:
        await service.drain()
        await bus.close()


async def test_a_version_weight_sync_lost_in_a_restart_is_pushed_again_while_the_step_waits(
    packer, nats_url, ray_client, tmp_path, monkeypatch
) -> None:
    """weight-sync killed after a version completed restarts knowing its number but not its bytes,
    and says so. A deployment still behind it can only get it from the trainer, which asks while the
    next step waits for its batch and pushes it again (the timed re-push is out of reach here)."""
    from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
    from services.modeling.config import ModelConfig
    from services.modeling.layouts import Layout, rank_params
    from services.trainer import loop
    from services.weights import WeightOnlyEngine, WeightStager, serve_engine
    from tests.support.weight_sync_process import start_weight_sync, wait_for, wait_ready

    monkeypatch.setattr(loop, "REPUSH_AFTER_S", 3600.0)
    packer_app, packer_address = packer
    run_id = f"tr-{uuid.uuid4().hex[:8]}"
    recipe = parse_recipe(RECIPE.format(steps=1))
    await packer_app.add_run(run_id, packer_app.settings_for(recipe))
    port = free_port()
    env = dict(
        os.environ,
        LOOPRL_WEIGHTSYNC_GRPC_PORT=str(port),
        LOOPRL_WEIGHTSYNC_NATS_URL=nats_url,
        LOOPRL_WEIGHTSYNC_RUN_ID=run_id,
        LOOPRL_WEIGHTSYNC_LOG_LEVEL="WARNING",
    )
    layout, config = Layout(1, "hf"), ModelConfig.tiny()
    engines = [WeightOnlyEngine(WeightStager(rank_params(config, layout, 0), rank=0)) for _ in range(2)]
    servers = [await serve_engine(e) for e in engines]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

    async def register(name: str, address: str) -> None:
        await ws.RegisterTarget(
            weightsync_pb2.RegisterTargetRequest(
                deployment=name,
                layout=weightsync_pb2.TargetLayout(tensor_parallel=1, naming="hf"),
                ranks=[weightsync_pb2.TargetRank(rank=0, address=address)],
            )
        )

    proc = start_weight_sync(env)
    app, service = await _trainer(nats_url, packer_address, str(tmp_path), f"127.0.0.1:{port}")
    try:
        await wait_ready(ws, proc, run_id)
        await register("early", servers[0][1])
        app.begin(run_id, recipe)  # pushes version 0, then waits for step 0's rollouts (none yet)
        await wait_for(lambda: engines[0].version == 0, timeout=120)
        proc.kill()
        proc.wait(10)
        proc = start_weight_sync(env)
        assert (await wait_ready(ws, proc, run_id)).latest_version == 0  # the number survived the kill
        await register("late", servers[1][1])
        await wait_for(lambda: engines[1].version == 0, timeout=60)
        assert (await ws.GetVersion(weightsync_pb2.GetVersionRequest(run_id=run_id))).latest_bytes_held
        bus = await Bus.connect(nats_url, name="test")
        await _publish_steps(bus, run_id, 0, 1)
        await bus.close()
        await asyncio.wait_for(app.wait(), timeout=120)
        assert app.run.state == "completed"
    finally:
        await channel.close()
        await service.drain()
        proc.kill()
        proc.wait(10)
        for server, _ in servers:
            await server.stop(None)
