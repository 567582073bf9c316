"""Every step trains a full batch on a real stack: groups the packer drops (equal rewards under
`filter_equal_rewards`, as DAPO's dynamic sampling; too stale under `max_staleness`) are replaced by
newly sampled groups, a run whose tasks never yield signal fails saying so instead of waiting, and
the run's logs (TensorBoard, MLflow, JSON lines) hold every scalar and samples table it recorded.

The runs share one stack (each brings its own deployments), run after run."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest

from gateway.run_logs import MLFLOW_DIR
from looprl.gateway.v1 import gateway_pb2
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from tests.support.run_logs import assert_logs_hold_the_run
from tests.support.runs import assert_accounting, run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE, Stack, local_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    with local_stack(tmp_path_factory.mktemp("fills")) as s:
        yield s


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def _assert_full_batches(run: gateway_pb2.Run) -> None:
    recipe_batch = int(re.search(r"^rollouts_per_step = (\d+)", run.recipe_toml, re.M).group(1))
    assert [h.step for h in run.history] == list(range(run.total_steps))
    assert [h.num_rollouts for h in run.history] == [recipe_batch] * run.total_steps
    assert run.resampled_groups == sum(h.resampled_groups for h in run.history)
    assert_accounting(run)


def test_a_synchronous_run_filtering_equal_rewards_trains_full_batches_and_logs_them(
    stack: Stack, tmp_path: Path
) -> None:
    steps = 8
    text = with_overrides(
        DEFAULT_RECIPE, run={"steps": steps}, algorithm={"advantage": "grpo"}, trainer={"checkpoint_every": 0}
    )
    text = text.replace("[algorithm]\n", "[algorithm]\nfilter_equal_rewards = true\n")
    text += '\n[logging]\nlogger = ["console", "tensorboard", "mlflow", "jsonl"]\nsamples_every = 3\n'
    reports = tmp_path / "reports"
    done = stack.looprl("run", str(_recipe(tmp_path, text)), "--report-dir", str(reports), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = re.search(r"^run (\S+) created$", done.stdout, re.M).group(1)
    run = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run

    _assert_full_batches(run)
    # A policy at random weights answers most prompts all wrong: groups of equal rewards were
    # dropped, each replaced, and none of them trained.
    dropped_groups = run.rollouts_dropped["zero_variance_group"] // 8
    assert run.resampled_groups == dropped_groups > 0
    assert all(h.reward_std > 0 for h in run.history)
    # Synchronous and on-policy: the trainer's log-probs are the sampler's.
    for h in run.history:
        assert h.importance_ratio_mean == pytest.approx(1.0, abs=1e-3), h
        assert h.importance_ratio_min <= 1.0 <= h.importance_ratio_max < 1.05
        assert h.importance_ratio_clipped == 0.0
    assert {s.step for s in run.samples} == {0, 3, 6}
    assert all(s.prompt and s.completion and s.response_tokens > 0 for s in run.samples)

    out = reports / run_id
    assert_logs_hold_the_run(out, (out / MLFLOW_DIR).resolve().as_uri(), run)
    assert "## Sample completions of step 6" in (out / "summary.md").read_text()


def test_a_run_whose_tasks_never_yield_signal_fails_saying_why(stack: Stack) -> None:
    # One-token answers to reversing 2-3 digits never have the right length: every reward is 0.
    text = with_overrides(
        DEFAULT_RECIPE,
        run={"steps": 5},
        environment={"reward": "digits_format"},
        sampling={"max_tokens": 1},
        trainer={"checkpoint_every": 0},
    )
    text = text.replace("[algorithm]\n", "[algorithm]\nfilter_equal_rewards = true\n")
    text = text.replace("[batch]\n", "[batch]\nmax_resample_batches = 1\n")
    run_id = f"no-signal-{int(time.time())}"
    stack.stub.CreateRun(
        gateway_pb2.CreateRunRequest(recipe_toml=text, run_id=run_id), metadata=stack.metadata
    )
    started = time.monotonic()
    final = None
    for update in stack.stub.WatchRun(
        gateway_pb2.WatchRunRequest(run_id=run_id), metadata=stack.metadata, timeout=180
    ):
        final = update.run
    assert final is not None and final.state == gateway_pb2.RUN_STATE_FAILED, final
    # More drops than the 8 groups (one step's worth) a step may replace; how many more depends on
    # how many the gateway had seen when it ended the run.
    dropped = re.match(r"step 0 cannot fill: the packer dropped (\d+) groups while it filled", final.error)
    assert dropped is not None and int(dropped.group(1)) > 8, final.error
    assert f"zero_variance_group {dropped.group(1)}" in final.error
    assert "algorithm.filter_equal_rewards" in final.error and "batch.max_resample_batches = 1" in final.error
    assert time.monotonic() - started < 120
    assert final.resampled_groups <= 8 and not final.history


async def _hold_some_rollouts(stack: Stack, run_id: str, until_step: int, held: list[int]) -> None:
    """Play a slow consumer on the packer's own durable: take a few of the run's first rollout
    messages and keep them (heartbeating) until the run trained `until_step` steps, then hand them
    back; by then their rollouts are too stale to train."""
    bus = await Bus.connect(stack.state.nats_url_for(), name="test-slow-consumer")
    try:
        consumer = None
        deadline = time.monotonic() + 120
        while consumer is None:
            try:  # the packer creates its durable once it packs the run; join it as it is
                info = await bus.js.consumer_info(subjects.ROLLOUTS, f"packer-{run_id}")
                consumer = await bus.pull_consumer(
                    subjects.ROLLOUTS,
                    f"packer-{run_id}",
                    subjects.rollouts(run_id),
                    ack_wait=info.config.ack_wait,
                    max_deliver=-1,
                    max_ack_pending=info.config.max_ack_pending,
                )
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        mine = []
        while len(mine) < 2 and time.monotonic() < deadline:
            mine += await consumer.fetch(1, timeout=0.05)
        held.append(len(mine))
        stub, metadata = stack.stub, stack.metadata
        while time.monotonic() < deadline:
            run = await asyncio.to_thread(
                stub.GetRun, gateway_pb2.GetRunRequest(run_id=run_id), metadata=metadata
            )
            if run.run.step >= until_step:
                break
            for d in mine:
                await d.in_progress()
            await asyncio.sleep(0.2)
        for d in mine:
            await d.nak()
    finally:
        await bus.close()


def test_an_asynchronous_run_whose_groups_go_stale_still_trains_full_batches(stack: Stack) -> None:
    steps = 12
    text = with_overrides(
        DEFAULT_RECIPE, run={"steps": steps, "max_staleness": 1}, trainer={"checkpoint_every": 0}
    )
    run_id = f"stale-{int(time.time())}"
    held: list[int] = []
    holder = threading.Thread(target=lambda: asyncio.run(_hold_some_rollouts(stack, run_id, 6, held)))
    holder.start()
    try:
        run = run_to_end(stack.stub, stack.metadata, text, run_id, timeout=300)
    finally:
        holder.join(timeout=150)
    assert held and held[0] > 0, "the test took none of the run's rollouts"
    _assert_full_batches(run)
    assert run.rollouts_dropped["stale"] > 0 and run.resampled_groups > 0
    assert max(h.max_staleness for h in run.history) <= 1
