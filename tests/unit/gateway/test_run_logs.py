"""The loggers of a run (gateway/run_logs.py) write every scalar and samples table of the run, once,
readable by TensorBoard's EventAccumulator and MLflow's client, and a follower that comes back later
writes only what is missing."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.report import scalars
from gateway.run_logs import METRICS_JSONL, MLFLOW_DIR, SAMPLES_JSONL, RunLogs
from looprl.gateway.v1 import gateway_pb2
from tests.support.run_logs import assert_logs_hold_the_run

RECIPE = """
[run]
name = "logs-test"
[logging]
logger = ["console", "tensorboard", "mlflow", "jsonl"]
samples_every = 5
"""


def _run(steps: int) -> gateway_pb2.Run:
    run = gateway_pb2.Run(
        run_id="logs-run", state=gateway_pb2.RUN_STATE_RUNNING, step=steps, total_steps=12, recipe_toml=RECIPE
    )
    for s in range(steps):
        run.history.add(
            step=s,
            reward_mean=0.1 + 0.01 * s,
            reward_std=0.05,
            loss=-0.01 * s,
            entropy=2.0 - 0.01 * s,
            mean_response_tokens=8 + s % 4,
            importance_ratio_mean=1.0 + 0.001 * s,
            importance_ratio_max=1.3,
            importance_ratio_min=0.8,
            importance_ratio_clipped=0.01 * s,
            resampled_groups=s % 3,
            num_rollouts=16,
        )
        run.weight_syncs.add(deployment="logs-run/default", version=s, sync_seconds=0.01 * (s + 1), bytes=10)
        if s % 5 == 0:
            # A held-out evaluation: its figures are logged like the history's, by source too.
            evaluation = run.evaluations.add(
                step=s, pass_at_1=0.1 * s, pass_at_k=0.2 * s, k=4, mean_reward=0.3
            )
            evaluation.sources["arith"].pass_at_1 = 0.05 * s
            for i in range(3):
                run.samples.add(
                    step=s,
                    rollout_id=f"r{s}.{i}",
                    group_id=f"g{s}",
                    prompt=f"reverse {s}{i} | now\nplease",
                    completion=f"{i}{s}",
                    reward=0.5 * i,
                    advantage=-1.0 + i,
                    response_tokens=2 + i,
                    tokens=9 + i,
                    weight_version=s,
                )
    return run


def test_every_scalar_and_samples_table_reads_back_from_tensorboard_and_mlflow(tmp_path: Path) -> None:
    # A follower logs the run as it goes, stops, and another takes over (`looprl watch`).
    first = RunLogs(tmp_path, _run(4))
    for steps in (1, 3, 4):
        first.update(_run(steps))
    later = _run(12)
    later.state = gateway_pb2.RUN_STATE_COMPLETED
    second = RunLogs(tmp_path, later)
    second.update(later)
    second.close(later)

    assert {"evaluations/pass_at_1", "evaluations/sources/arith/pass_at_1"} <= set(scalars(later))
    # Exactly once each: what the first follower wrote is not written again.
    assert_logs_hold_the_run(tmp_path, (tmp_path / MLFLOW_DIR).resolve().as_uri(), later)

    lines = [json.loads(line) for line in (tmp_path / METRICS_JSONL).read_text().splitlines()]
    logged = {}
    for line in lines:
        for tag, value in line.items():
            if tag not in ("step", "time"):
                assert (tag, line["step"]) not in logged, f"{tag} of step {line['step']} logged twice"
                logged[(tag, line["step"])] = value
    assert logged == {(tag, step): value for tag, points in scalars(later).items() for step, value in points}
    samples = [json.loads(line) for line in (tmp_path / SAMPLES_JSONL).read_text().splitlines()]
    assert [s["rollout_id"] for s in samples] == [row.rollout_id for row in later.samples]


def test_a_run_whose_recipe_logs_nowhere_writes_no_logs(tmp_path: Path) -> None:
    run = _run(3)
    run.recipe_toml = RECIPE.replace('["console", "tensorboard", "mlflow", "jsonl"]', '["console"]')
    logs = RunLogs(tmp_path, run)
    logs.update(run)
    assert not logs.sinks
    assert not any(p.name != "logged.json" for p in tmp_path.iterdir())


def test_a_tracking_server_that_cannot_be_reached_leaves_the_other_logs_and_the_follower_running(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run = _run(3)
    run.recipe_toml = RECIPE.replace("samples_every = 5", f'mlflow_tracking_uri = "http://127.0.0.1:{port}"')
    logs = RunLogs(tmp_path, run)
    logs.update(run)
    logs.close(run)
    assert [s.name for s in logs.sinks] == ["tensorboard", "jsonl"]
    assert "logging to mlflow is off" in capsys.readouterr().err
    assert len((tmp_path / METRICS_JSONL).read_text().splitlines()) == 3
    # What MLflow missed is still owed: `looprl watch` backfills it once the server answers.
    assert not json.loads((tmp_path / "logged.json").read_text()).get("mlflow", {}).get("through")
