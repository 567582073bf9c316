"""Chaos matrix: during one run, SIGKILL (as an OOM kill or a crash would) and restart each component
the run depends on, one after the other, and take reward down for 30 s. After each fault the run
must train on (the seconds until it has trained two more steps are its recovery time, printed as a
table), and at the end it completes with every rollout trained exactly once or dropped for a reason.

Losing the Ray head takes every actor of the run with it: the trainer and the router notice, wait
for the new head and restart their processes into it (services/kit/ray/head_loss.py); the trainer
resumes from its last checkpoint, the router recreates its replicas at the latest weights.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from gateway.stack import StackState
from looprl.gateway.v1 import gateway_pb2
from services.kit.local.infra import session_pids
from tests.support.runs import assert_accounting, with_overrides
from tests.support.stack import DEFAULT_RECIPE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 100  # enough that every fault lands mid-run (a fault costs ~3-5 steps of progress)
RECOVERY_STEPS = 2  # steps the run must train after a fault to count as recovered
RECOVERY_LIMIT_S = 150.0  # longest any fault may hold the run (reward's outage is 30 s of it)


def get_run(stack, run_id: str) -> gateway_pb2.Run:
    while True:
        try:
            return stack.stub.GetRun(
                gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata, timeout=5
            ).run
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            time.sleep(0.3)


def wait_until(stack, run_id: str, done, timeout: float) -> gateway_pb2.Run:
    deadline = time.monotonic() + timeout
    while True:
        run = get_run(stack, run_id)
        if done(run):
            return run
        assert time.monotonic() < deadline, f"not met within {timeout:.0f}s: {run.state} {run.error}"
        time.sleep(0.2)


def start_run(stack, run_id: str, steps: int) -> str:
    """The default recipe for `steps` (a checkpoint every 5), once it has trained 3 steps."""
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": steps}, trainer={"checkpoint_every": 5})
    stack.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=recipe, run_id=run_id), metadata=stack.metadata
    )
    wait_until(stack, run_id, lambda r: r.step >= 3, timeout=240)
    return run_id


def ray_worker_pid(stack, title: str) -> int:
    """A Ray worker process of this stack's Ray head (not another stack's) running `title`."""
    for pid in session_pids(stack.state.ray_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].decode().startswith(title):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no {title} process under the stack's Ray head")


def restart(stack, name: str) -> None:
    restarted = stack.looprl("restart", name, "--kill")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr


def reward_down_30s(stack) -> None:
    reward = StackState.load(stack.state_dir.resolve()).service("reward")  # its pid after `restart`
    os.killpg(reward.pid, signal.SIGKILL)
    time.sleep(30)
    restarted = stack.looprl("restart", "reward")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr


FAULTS = {
    "inference-router": lambda stack: restart(stack, "inference-router"),
    "replica actor": lambda stack: os.kill(ray_worker_pid(stack, "ray::ReplicaActor"), signal.SIGKILL),
    "environment-sandbox": lambda stack: restart(stack, "environment-sandbox"),
    "reward": lambda stack: restart(stack, "reward"),
    "reward down 30 s": reward_down_30s,
    "weight-sync": lambda stack: restart(stack, "weight-sync"),
    "nats-server": lambda stack: restart(stack, "nats-server"),
    "rollout-packer": lambda stack: restart(stack, "rollout-packer"),  # holding unacked rollouts
    "gateway": lambda stack: restart(stack, "gateway"),  # driving the run
    "trainer": lambda stack: restart(stack, "trainer"),  # between checkpoints
    "trainer rank": lambda stack: os.kill(ray_worker_pid(stack, "ray::TrainerWorker"), signal.SIGKILL),
    # Last: its restart kills every actor of the run and restarts the trainer and router processes.
    "Ray head": lambda stack: restart(stack, "ray-head"),
}


def test_the_run_survives_every_component_crash_and_a_30s_reward_outage(fresh_stack, capsys) -> None:
    stack = fresh_stack
    run_id = start_run(stack, "chaos-matrix", steps=STEPS)
    recovery: dict[str, float] = {}
    for fault, inject in FAULTS.items():
        at = get_run(stack, run_id).step
        assert at < STEPS - RECOVERY_STEPS, f"the run ended before the {fault} fault"
        started = time.monotonic()
        inject(stack)
        # Steps already in flight when the fault hit do not count as recovered.
        at = max(at, get_run(stack, run_id).step)
        run = wait_until(
            stack,
            run_id,
            lambda r, at=at: r.step >= at + RECOVERY_STEPS or r.state != gateway_pb2.RUN_STATE_RUNNING,
            timeout=RECOVERY_LIMIT_S,
        )
        assert run.state == gateway_pb2.RUN_STATE_RUNNING, f"after {fault}: {run.state} {run.error}"
        recovery[fault] = time.monotonic() - started

    final = None
    for update in stack.stub.WatchRun(
        gateway_pb2.WatchRunRequest(run_id=run_id), metadata=stack.metadata, timeout=600
    ):
        final = update.run
    with capsys.disabled():
        print("\nfault                  recovery (s, until 2 more steps trained)")
        for fault, seconds in recovery.items():
            print(f"{fault:<22} {seconds:6.1f}")
    assert final is not None and final.state == gateway_pb2.RUN_STATE_COMPLETED, final
    assert_accounting(final)
    assert final.weight_version == STEPS
    trainer_log = (stack.state_dir / "logs" / "trainer.log").read_text()
    assert "recreating the ranks" in trainer_log
    assert "resumed from" in trainer_log  # the restarted trainer resumed from its checkpoint
    # Both Ray drivers noticed the lost head and restarted into the new cluster.
    for log in (trainer_log, (stack.state_dir / "logs" / "inference-router.log").read_text()):
        assert "a new Ray head is up" in log
    # The weight-sync kill is survived one of two ways, by when it lands: a push it cut off is
    # retried, or a version it had completed but not yet delivered is pushed again.
    assert "retry 1" in trainer_log or "pushed it again" in trainer_log
