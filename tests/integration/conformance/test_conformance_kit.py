"""The conformance kit where its stateful cases may run against looprl's own parts: a replica (the
CPU engine and its weight lifecycle, as its own process with mutual TLS) that serves no run, whose
weights the kit stages, commits, aborts and rolls back; and a packer serving a run no trainer
consumes, fed rollouts here, whose steps the kit takes and acknowledges as the run's trainer. A broken
variant of each (an engine that commits an unverified version, a packer that acknowledges a step
twice) fails exactly the case that checks that promise.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest

from bench.harness.synthetic_rollouts import make_rollout
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.messages import rollouts as rollout_messages
from services.kit.rpc import tls
from services.rollout_packer.step import PackerSettings
from tests.support.external_parts import serving
from tests.support.kit_runs import broken_variant_fails, failed_cases
from tests.support.packer import running_packer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ENGINE_OPTIONS = {"max_model_len": "128"}


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tls.generate_dev_pki(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def replica(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("replica") / "replica.log"
    with serving(
        [sys.executable, "-m", "tests.support.replica_process", "--tls-dir", str(tls_dir)], ROOT, log
    ) as address:
        yield address


def test_looprls_engine_passes_the_engine_kit(replica: str, tls_dir: Path) -> None:
    assert failed_cases("inference-engine", replica, tls_dir, ENGINE_OPTIONS) == {}


def test_an_engine_that_commits_an_unverified_version_fails_the_checksum_case(
    replica: str, tls_dir: Path
) -> None:
    expected, failed = broken_variant_fails(
        "inference-engine", replica, tls_dir, "inference-router", ENGINE_OPTIONS
    )
    assert set(failed) == {expected}, failed
    assert "answered OK" in failed[expected] and "expected DATA_LOSS" in failed[expected]


async def _packed_run(app, nats_url: str) -> str:
    """A run of two groups of four rollouts per step, one step's worth published."""
    run_id = f"kit-{uuid.uuid4().hex[:8]}"
    await app.add_run(
        run_id, PackerSettings(prompts_per_step=2, group_size=4, world_size=1, max_tokens_per_microbatch=64)
    )
    bus = await Bus.connect(nats_url, name="test-publisher")
    try:
        for group in ("g1", "g2"):
            rollouts = [
                make_rollout(
                    f"{run_id}-{group}-{i}",
                    group,
                    run_id=run_id,
                    group_size=4,
                    sample_index=i,
                    reward=float(i % 2),
                    seed=i,
                    completion_len=3 + i,
                )
                for i in range(4)
            ]
            messages = rollout_messages.group_messages(rollouts, bus.nc.max_payload)
            await bus.publish_batch(subjects.rollouts(run_id), messages, rollout_messages.GROUP_HEADERS)
    finally:
        await bus.close()
    return run_id


async def test_looprls_packer_passes_the_packer_kit_as_a_runs_trainer(nats_url: str) -> None:
    async with running_packer(nats_url) as (app, service):
        run_id = await _packed_run(app, nats_url)
        options = {"run": run_id, "wait": "20"}
        failed = await asyncio.to_thread(failed_cases, "rollout-packer", service.address, None, options)
        assert failed == {}
        assert app.runs[run_id].acked_total == 8  # the kit, as the trainer, acknowledged the step


async def test_a_packer_that_acknowledges_twice_fails_the_idempotency_case(nats_url: str) -> None:
    async with running_packer(nats_url) as (app, service):
        run_id = await _packed_run(app, nats_url)
        expected, failed = await asyncio.to_thread(
            broken_variant_fails,
            "rollout-packer",
            service.address,
            None,
            "rollout-packer",
            {"run": run_id, "wait": "20"},
        )
    assert set(failed) == {expected}, failed
    assert "acknowledged 8 rollouts again" in failed[expected]
