"""The report `looprl run` ends with, on a real stack: the grid image exists, and every panel of it
is drawn from the run's own records as GetRun returns them (per-step history and every weight
delivery), with the trainer's entropy and response lengths really recorded."""

from __future__ import annotations

import csv
import re

import matplotlib.pyplot as plt
import pytest

from gateway.report import GRID_IMAGE, HISTORY_CSV, SUMMARY, grid_figure
from looprl.gateway.v1 import gateway_pb2
from tests.support.report import assert_grid_matches_records
from tests.support.runs import assert_accounting, with_overrides
from tests.support.stack import DEFAULT_RECIPE

pytestmark = pytest.mark.slow

STEPS = 6


def test_looprl_run_writes_a_grid_of_the_runs_own_records(fresh_stack, tmp_path) -> None:
    recipe = tmp_path / "short.toml"
    recipe.write_text(with_overrides(DEFAULT_RECIPE, run={"steps": STEPS}))
    reports = tmp_path / "reports"
    done = fresh_stack.looprl("run", str(recipe), "--report-dir", str(reports), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = re.search(r"^run (\S+) created$", done.stdout, re.M).group(1)
    out = reports / run_id
    assert (out / GRID_IMAGE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"report: {out / GRID_IMAGE}" in done.stdout

    run = fresh_stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=fresh_stack.metadata).run
    assert_accounting(run)
    # What the trainer and weight-sync measured reached the run's records.
    assert all(h.entropy > 0 and h.mean_response_tokens >= 1 and h.grad_norm > 0 for h in run.history)
    deployments = {d.deployment for d in run.deployments}
    assert deployments
    # Version 0 is pushed at start; the last step's version may land after the run completes.
    for name in deployments:
        versions = {w.version for w in run.weight_syncs if w.deployment == name}
        assert set(range(STEPS)) <= versions, f"{name}: deliveries of versions {sorted(versions)}"
    assert all(w.sync_seconds > 0 and w.bytes > 0 for w in run.weight_syncs)

    fig = grid_figure(run)
    try:
        assert_grid_matches_records(fig, run)
    finally:
        plt.close(fig)
    # The files the CLI wrote hold the same records.
    with (out / HISTORY_CSV).open() as f:
        written = list(csv.DictReader(f))
    assert [int(h["step"]) for h in written] == [h.step for h in run.history]
    for row, h in zip(written, run.history, strict=True):
        assert float(row["entropy"]) == pytest.approx(h.entropy)
        assert float(row["mean_response_tokens"]) == pytest.approx(h.mean_response_tokens)
    assert f"{STEPS} of {STEPS} steps" in (out / SUMMARY).read_text()
