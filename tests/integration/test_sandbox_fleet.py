"""Sandbox workers as real Ray actors: executions run isolated inside them, and the fleet grows
under a queue and shrinks when idle."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.environment_sandbox.sandbox import ExecJob, SandboxConfig
from services.environment_sandbox.sandbox.fleet import FleetConfig, SandboxFleet

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="sandbox needs root")]


async def test_fleet_scales_with_queue_depth_and_runs_isolated(ray_client):
    fleet = await SandboxFleet(
        FleetConfig(
            min_actors=1,
            max_actors=2,
            target_queue_per_actor=2,
            scale_interval_s=0.05,
            scale_down_after_s=0.5,
        ),
        SandboxConfig(warm_workers=1, max_concurrency=4),
    ).start()
    try:
        code = "import os, time\ntime.sleep(0.3)\nprint(os.getuid() >= 600000)"
        results = await asyncio.gather(*(fleet.execute(ExecJob(code)) for _ in range(12)))
        assert all(r.exit_code == 0 and r.stdout.strip() == "True" for r in results), results[0]
        assert all("netns" in r.isolation for r in results)
        assert fleet.peak_actors == 2
        for _ in range(100):
            if fleet.actors == 1:
                break
            await asyncio.sleep(0.05)
        assert fleet.actors == 1
    finally:
        await fleet.close()
