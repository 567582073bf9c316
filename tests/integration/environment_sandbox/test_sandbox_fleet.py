"""Sandbox workers as real Ray actors: executions run isolated inside them, the fleet grows under a
queue and shrinks when idle, and an actor Ray cannot place fails executions instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from looprl.environment.v1 import environment_pb2
from services.environment_sandbox.sandbox import ExecJob, SandboxConfig, SandboxError
from services.environment_sandbox.sandbox.fleet import FleetConfig, SandboxFleet, sandbox_actor_class
from services.environment_sandbox.servicer import EnvironmentSandboxServicer
from services.kit.rpc.errors import ServiceError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="sandbox needs root")]


async def test_fleet_scales_with_queue_depth_and_runs_isolated(ray_client):
    fleet = await SandboxFleet(
        FleetConfig(
            min_actors=1,
            max_actors=2,
            target_queue_per_actor=2,
            scale_interval_s=0.05,
            scale_down_after_s=0.5,
            actor_start_timeout_s=60,
        ),
        SandboxConfig(warm_workers=1, max_concurrency=4),
    ).start()
    try:
        code = "import os, time\ntime.sleep(0.3)\nprint(os.getuid() >= 600000)"
        jobs = (fleet.execute(ExecJob(code)) for _ in range(12))
        results = await asyncio.wait_for(asyncio.gather(*jobs), 120)
        assert all(r.exit_code == 0 and r.stdout.strip() == "True" for r in results), results[0]
        assert all("netns" in r.isolation for r in results)
        assert fleet.peak_actors == 2
        for _ in range(100):
            if fleet.actors == 1:
                break
            await asyncio.sleep(0.05)
        assert fleet.actors == 1
    finally:
        await asyncio.wait_for(fleet.close(), 30)


async def test_an_actor_ray_cannot_place_fails_executions_with_the_reason(ray_client):
    config = SandboxConfig(warm_workers=1)
    fleet = await SandboxFleet(
        FleetConfig(min_actors=1, max_actors=1, actor_start_timeout_s=2),
        config,
        make_actor=lambda: sandbox_actor_class().options(num_cpus=100_000).remote(config.model_dump()),
    ).start()
    try:
        started = time.monotonic()
        # Whichever notices first (the actor's own start watch, or the call waiting for any started
        # actor), the error names the setting and the reason.
        with pytest.raises(SandboxError, match=r"within actor_start_timeout_s=2 s\W+Ray has not placed"):
            await asyncio.wait_for(fleet.execute(ExecJob("print(1)")), 30)
        assert time.monotonic() - started < 10
        # Through the service: a caller gets a status it may retry, with the reason.
        servicer = EnvironmentSandboxServicer(fleet, runner=None)
        with pytest.raises(ServiceError) as refused:
            await asyncio.wait_for(servicer.Exec(environment_pb2.ExecRequest(code="print(1)"), None), 30)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "actor_start_timeout_s=2 s" in str(refused.value)
    finally:
        await asyncio.wait_for(fleet.close(), 30)


async def test_workspaces_on_the_fleet_stay_on_their_actor_and_pin_it(ray_client):
    """An episode's workspace and its forks live on the actor holding their layers, and live
    workspaces count as load: a fleet allowed to shrink to nothing keeps that actor while they live."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[3] / "configs" / "data" / "repo_corpus" / "repos"
    fleet = await SandboxFleet(
        FleetConfig(min_actors=0, max_actors=2, scale_interval_s=0.05, scale_down_after_s=0.2),
        SandboxConfig(warm_workers=0, uid_base=750000),
    ).start()
    workspaces = fleet.workspaces
    try:
        first = await asyncio.wait_for(workspaces.open(str(corpus / "primes")), 120)
        await workspaces.run(first["id"], ["bash", "-c", "echo changed >> README.md"])
        forked = await workspaces.fork(first["id"])
        assert fleet.queue_depth == 2  # two live workspaces
        await asyncio.sleep(1.0)  # idle for longer than scale_down_after_s
        assert fleet.actors == 1
        seen = await workspaces.run(forked["id"], ["tail", "-1", "README.md"])
        assert seen["output"] == "changed\n" and seen["exit_code"] == 0
        assert workspaces._where[first["id"]] is workspaces._where[forked["id"]]
        for w in (first, forked):
            await workspaces.close(w["id"])
        assert fleet.queue_depth == 0
        for _ in range(100):
            if fleet.actors == 0:
                break
            await asyncio.sleep(0.05)
        assert fleet.actors == 0  # nothing pins it any more
        with pytest.raises(SandboxError, match="no such live workspace"):
            await workspaces.run(first["id"], ["true"])
    finally:
        await asyncio.wait_for(fleet.close(), 30)
