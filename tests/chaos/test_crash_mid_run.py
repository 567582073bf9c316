"""Chaos: crash services in the middle of a run (SIGKILL, as an OOM kill or a node loss would) and
restart them: the packer (holding un-acked rollouts), the gateway (driving the run) and the trainer
(between checkpoints). The run must still complete with every rollout trained exactly once or
dropped for a recorded reason, the restarted gateway must continue the run, and the trainer must
resume from its checkpoint.
"""

from __future__ import annotations

import time

import grpc
import pytest

from looprl.gateway.v1 import gateway_pb2
from tests.support.runs import assert_accounting, with_overrides
from tests.support.stack import DEFAULT_RECIPE

pytestmark = pytest.mark.slow


def wait_for_step(stack, run_id: str, step: int, timeout: float = 240) -> gateway_pb2.Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            run = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run
        except grpc.RpcError as exc:  # the gateway itself may be restarting
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        else:
            if run.step >= step:
                return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not reach step {step}")


def test_packer_gateway_and_trainer_crashes_mid_run_lose_and_duplicate_nothing(fresh_stack) -> None:
    stack = fresh_stack
    # Long enough that each kill lands mid-run: a step takes ~0.15 s here, and `looprl restart` needs a
    # second or two of interpreter start before it kills.
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": 60}, trainer={"checkpoint_every": 3})
    run_id = "chaos-run"
    stack.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id=run_id), metadata=stack.metadata
    )

    wait_for_step(stack, run_id, 4)
    restarted = stack.looprl("restart", "rollout-packer", "--kill")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr

    wait_for_step(stack, run_id, 6)
    restarted = stack.looprl("restart", "gateway", "--kill")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr

    wait_for_step(stack, run_id, 8)
    restarted = stack.looprl("restart", "trainer", "--kill")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr

    final = None
    for update in stack.stub.WatchRun(
        gateway_pb2.WatchRunRequest(run_id=run_id), metadata=stack.metadata, timeout=300
    ):
        final = update.run
    assert final is not None and final.state == gateway_pb2.RUN_STATE_COMPLETED, final
    assert_accounting(final)
    assert final.weight_version == 60
    trainer_log = (stack.state_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log, "the restarted trainer did not resume from its checkpoint"
