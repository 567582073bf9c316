"""A run's driver follows what the packer writes for it (step plans, dropped groups, samples tables):
a samples table the run record cannot keep (its chunk would pass the server's max_payload, as long
completions with a large `logging.samples_per_step` make it) is left out, and the plans and drops
written after it still reach the driver (a synchronous run waits for its drops' replacements).
Against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import uuid

from gateway.run_store import RunStore
from gateway.runs import RunDriver
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import RunRecord
from services.kit.messages import packer_reports

RECIPE = "[logging]\nsamples_every = 1\n"


async def test_a_samples_table_too_large_to_keep_does_not_stop_the_plans_and_drops_after_it(
    nats_url: str,
) -> None:
    bus = await Bus.connect(nats_url, name="packer-watch-test")
    try:
        await bus.ensure_streams()
        store = RunStore(await bus.kv(subjects.RUNS))
        run_id = f"watch-{uuid.uuid4().hex[:6]}"
        await store.create(RunRecord(run_id=run_id, recipe_toml=RECIPE, state="running"))
        packer = await bus.kv(subjects.PACKER_STEPS)
        # Two tables of 0.6 of the server's max_payload each: one chunk of the record cannot hold both.
        rows = [{"prompt": "p", "completion": "x" * int(0.6 * bus.nc.max_payload)}]
        for step in (0, 1):
            await packer.put(subjects.packer_samples_key(run_id, step), json.dumps(rows).encode())
        drop = packer_reports.GroupDrop(f"{run_id}.s2.g0", "zero_variance_group", "all rewards equal")
        await packer.put(subjects.packer_drops_key(run_id, 2), packer_reports.encode_drops([drop]))

        driver = RunDriver(bus, store, run_id)
        follower = asyncio.create_task(driver._follow_packer())
        try:
            for _ in range(100):
                if driver._drops:
                    break
                await asyncio.sleep(0.05)
            assert [d.group_id for d in driver._drops.get(2, [])] == [drop.group_id]
            assert not follower.done(), follower
        finally:
            follower.cancel()
        kept = await store.kv.get(f"{run_id}.samples.0")
        assert kept is not None and [r["step"] for r in json.loads(kept)] == [0]
    finally:
        await bus.close()
