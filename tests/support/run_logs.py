"""Reading a run's logs back with the tools practitioners use: TensorBoard's own EventAccumulator and
MLflow's client, checked against the run's records (GetRun's history, deliveries and samples)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from gateway.report import panels, samples_markdown, scalars
from gateway.run_logs import MLFLOW_RUN_TAG, SAMPLES_TAG, TENSORBOARD_DIR, mlflow_key
from looprl.gateway.v1 import gateway_pb2


def tensorboard_scalars(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[int, str]]:
    """(scalars by tag, samples text by step) as TensorBoard reads the event files."""
    acc = EventAccumulator(str(directory / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    # sorted: a follower that took over wrote a file of its own, which TensorBoard may read first
    values = {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in tags["scalars"]}
    texts = {
        e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode()
        for tag in tags["tensors"]
        if tag.startswith(SAMPLES_TAG)
        for e in acc.Tensors(tag)
    }
    return values, texts


def mlflow_run(tracking_uri: str, run_id: str):
    """(client, MLflow run) of the looprl run, found by its tag."""
    if tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads it only when asked
    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (found,) = client.search_runs(experiments, f"tags.`{MLFLOW_RUN_TAG}` = '{run_id}'")
    return client, found


def assert_logs_hold_the_run(directory: Path, tracking_uri: str, run: gateway_pb2.Run) -> None:
    """Every scalar of the run (so every line the report draws) and every samples table, exactly
    once each, in TensorBoard's event files and in MLflow."""
    expected = scalars(run)
    drawn = {s.tag for p in panels(run) for s in p.series} | {
        s.spread_tag for p in panels(run) for s in p.series if s.spread_tag
    }
    assert drawn <= set(expected), f"the report draws scalars that are not logged: {drawn - set(expected)}"
    tables = {}
    for row in run.samples:
        tables.setdefault(row.step, []).append(row)
    assert tables, "the run recorded no samples table"

    tb, texts = tensorboard_scalars(directory)
    client, found = mlflow_run(tracking_uri, run.run_id)
    for tag, points in expected.items():
        assert [s for s, _ in tb.get(tag, [])] == [s for s, _ in points], f"TensorBoard {tag}"
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-6)
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(found.info.run_id, mlflow_key(tag))
        )
        assert [s for s, _ in history] == [s for s, _ in points], f"MLflow {tag}"
        assert [v for _, v in history] == pytest.approx([v for _, v in points], rel=1e-12, abs=1e-12)

    assert texts == {step: samples_markdown(rows) for step, rows in tables.items()}
    for step, rows in tables.items():
        path = client.download_artifacts(found.info.run_id, f"{SAMPLES_TAG}/step_{step:06d}.json")
        table = json.loads(Path(path).read_text())
        records = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
        assert [r["rollout_id"] for r in records] == [row.rollout_id for row in rows]
        for record, row in zip(records, rows, strict=True):
            for column in (
                "prompt",
                "completion",
                "reward",
                "advantage",
                "response_tokens",
                "weight_version",
            ):
                assert record[column] == pytest.approx(getattr(row, column)), column
