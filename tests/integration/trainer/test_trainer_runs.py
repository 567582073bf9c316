"""Two runs trained side by side by one trainer following the run records in KV "runs", on the
session's real Ray head and the real rollout-packer: each run gets its own rank group, and a run
whose record turns final writes its final checkpoint and frees its placement group and actors in
Ray while the other run keeps training."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord, parse_recipe
from services.kit.local.infra import NatsServer, free_port
from services.kit.rpc.server import Service
from services.trainer.checkpoint import list_checkpoints
from services.trainer.config import TrainerConfig
from services.trainer.runs import TrainerApp
from services.trainer.servicer import TrainerServicer
from tests.integration.trainer.test_trainer_service import RECIPE, _publish_steps, _train_records
from tests.support.packer import running_packer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory):
    """A nats-server of this module's own: the trainer here trains every active record in KV "runs",
    and other tests' records must not become its runs."""
    server = NatsServer(state_dir=tmp_path_factory.mktemp("nats-runs"), port=free_port()).start()
    yield server.url
    server.stop()


@pytest.fixture
async def packer(nats_url):
    async with running_packer(nats_url) as (app, service):
        yield app, service.address


async def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return result


def _placement_groups(run_id: str) -> dict[str, str]:
    """This run's placement groups in Ray: id -> state."""
    from ray.util import placement_group_table

    return {
        pg_id: pg["state"]
        for pg_id, pg in placement_group_table().items()
        if pg["name"].startswith(f"looprl-trainer-{run_id}-")
    }


async def test_two_runs_train_on_their_own_ranks_and_a_final_record_frees_only_its_own(
    packer, nats_url, ray_client, tmp_path
) -> None:
    import ray

    packer_app, packer_address = packer
    recipe_toml = RECIPE.format(steps=50)
    run_a, run_b = (f"tr-{uuid.uuid4().hex[:8]}" for _ in range(2))
    bus = await Bus.connect(nats_url, name="test")
    await bus.ensure_streams()
    runs_kv = await bus.kv(subjects.RUNS)
    for run_id in (run_a, run_b):
        await packer_app.add_run(run_id, packer_app.settings_for(parse_recipe(recipe_toml)))
        await _publish_steps(bus, run_id, 0, 1)
    cfg = TrainerConfig(
        nats_url=nats_url,
        grpc_port=free_port(),
        metrics_port=free_port(),
        packer_address=packer_address,
        checkpoint_dir=str(tmp_path),
        next_batch_timeout_s=2.0,
        grace_seconds=60.0,
    )
    app = TrainerApp(cfg)
    service = Service("trainer", cfg)
    service.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(app))
    service.on_shutdown(app.stop)
    channel = grpc.aio.insecure_channel(service.address)
    try:
        await service.start()
        await app.start()
        await service.mark_ready()
        await runs_kv.put(run_a, RunRecord(run_a, recipe_toml, state="pending").to_json())
        await runs_kv.put(run_b, RunRecord(run_b, recipe_toml, state="running").to_json())
        await asyncio.gather(_train_records(bus, run_a, 1), _train_records(bus, run_b, 1))

        a, b = app.runs[run_a], app.runs[run_b]
        assert a.group.pg.id != b.group.pg.id
        assert not {h._actor_id for h in a.group.actors} & {h._actor_id for h in b.group.actors}
        assert list(_placement_groups(run_a).values()) == ["CREATED"]
        assert list(_placement_groups(run_b).values()) == ["CREATED"]
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        status = await stub.Status(trainer_pb2.StatusRequest())
        assert [(r.run_id, r.state, r.step) for r in status.runs] == [
            (run_a, "training", 1),
            (run_b, "training", 1),
        ]

        a_actors = list(a.group.actors)
        cpus_before = ray.available_resources().get("CPU", 0.0)
        await runs_kv.put(run_a, RunRecord(run_a, recipe_toml, state="stopped").to_json())
        await _until(lambda: not app.live(run_a), 60, f"run {run_a} to stop")
        assert a.state == "stopped" and a.step == 1
        assert [p.name for p in list_checkpoints(tmp_path / run_a)] == ["step_00000001"]
        assert list(_placement_groups(run_a).values()) == ["REMOVED"]
        for actor in a_actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.rendezvous_address.remote(), timeout=30)
        # Its two ranks' bundles (0.5 CPU each) are back in the cluster.
        await _until(
            lambda: ray.available_resources().get("CPU", 0.0) >= cpus_before + 1.0, 30, "the run's CPUs"
        )

        # The other run goes on training its steps on its own ranks.
        assert app.live(run_b) and list(_placement_groups(run_b).values()) == ["CREATED"]
        await _publish_steps(bus, run_b, 1, 1)
        records = await _train_records(bus, run_b, 2)
        assert [r.step for r in records] == [0, 1]
        per_run = await stub.Status(trainer_pb2.StatusRequest(run_id=run_b))
        assert (per_run.state, per_run.step) == ("training", 2)

        await service.drain()  # SIGTERM: the last run stops and frees its ranks too
        assert b.state == "stopped" and list(_placement_groups(run_b).values()) == ["REMOVED"]
    finally:
        await channel.close()
        await service.drain()
        await bus.close()
