"""The end-of-run report: a grid image whose every panel is the run's records, a summary table of
every k-th step plus the last ones, and every step in history.csv."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from gateway.report import GRID_IMAGE, HISTORY_CSV, TABLE_TAIL, grid_figure, table_steps, write_report
from looprl.gateway.v1 import gateway_pb2
from tests.support.report import assert_grid_matches_records

STEPS = 130


def _run(steps: int = STEPS) -> gateway_pb2.Run:
    run = gateway_pb2.Run(
        run_id="report-run", state=gateway_pb2.RUN_STATE_COMPLETED, step=steps, total_steps=steps
    )
    for s in range(steps):
        run.history.add(
            step=s,
            reward_mean=0.1 + 0.002 * s,
            reward_std=0.05 + 0.001 * (s % 7),
            loss=-0.01 * math.sin(s),
            entropy=2.0 - 0.01 * s,
            kl=0.001 * s,
            clip_fraction=0.01 * (s % 5),
            grad_norm=1.0 + 0.1 * (s % 3),
            mean_response_tokens=8 + s % 4,
            mean_staleness=0.5 * (s % 3),
            max_staleness=s % 3,
            train_tokens_per_second=1000 + 3 * s,
            num_rollouts=64,
            seconds=0.3,
        )
    # Two deployments; the second skips versions (a slower one catches up).
    for v in range(steps + 1):
        run.weight_syncs.add(deployment="short", version=v, sync_seconds=0.01 + 0.0001 * v, bytes=1000)
        if v % 2 == 0:
            run.weight_syncs.add(deployment="long", version=v, sync_seconds=0.02 + 0.0002 * v, bytes=1000)
    return run


def test_every_panel_of_the_grid_draws_the_runs_records() -> None:
    run = _run()
    fig = grid_figure(run)
    try:
        assert_grid_matches_records(fig, run)
    finally:
        plt.close(fig)


def test_the_checker_notices_a_panel_that_is_not_the_records() -> None:
    run = _run(10)
    fig = grid_figure(run)
    other = _run(10)
    other.history[4].kl += 1.0
    try:
        with pytest.raises(AssertionError, match="KL to reference"):
            assert_grid_matches_records(fig, other)
    finally:
        plt.close(fig)


def test_report_writes_the_grid_a_condensed_table_and_every_step(tmp_path: Path) -> None:
    run = _run()
    summary = write_report(run, tmp_path)
    image = tmp_path / GRID_IMAGE
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 20_000
    rows = [line for line in summary.read_text().splitlines() if line.startswith("| ") and "step" not in line]
    shown = [int(r.split("|")[1]) for r in rows]
    assert shown == table_steps(STEPS)
    assert len(shown) <= 45 and shown[:2] == [0, 4]  # every 4th of 130 steps, then the last ones
    assert shown[-TABLE_TAIL:] == list(range(STEPS - TABLE_TAIL, STEPS))
    with (tmp_path / HISTORY_CSV).open() as f:
        history = list(csv.DictReader(f))
    assert [int(h["step"]) for h in history] == list(range(STEPS))
    assert float(history[77]["kl"]) == pytest.approx(run.history[77].kl)


def test_table_steps_keep_short_runs_whole_and_long_ones_short() -> None:
    assert table_steps(12) == list(range(12))
    long = table_steps(400)
    assert len(long) <= 45 and long[0] == 0 and long[-1] == 399 and 390 in long


def test_a_run_without_records_still_gets_a_report(tmp_path: Path) -> None:
    run = gateway_pb2.Run(run_id="empty", state=gateway_pb2.RUN_STATE_FAILED, error="no deployment")
    summary = write_report(run, tmp_path)
    assert (tmp_path / GRID_IMAGE).exists()
    assert "no deployment" in summary.read_text()


def test_a_lora_runs_summary_shows_its_adapter_its_bytes_per_version_and_its_share_of_a_shared_deployment(
    tmp_path: Path,
) -> None:
    run = _run(20)
    run.recipe_toml = (
        '[model]\npath = "m"\n[model.lora]\nrank = 8\nalpha = 16.0\n'
        '[[deployments]]\nname = "lora"\nshared = true\nmax_loras = 2\n'
    )
    del run.weight_syncs[:]
    for v in range(3):
        run.weight_syncs.add(deployment="run/lora", version=v, sync_seconds=0.01, bytes=1_376_256)
    text = write_report(run, tmp_path).read_text()
    assert "- bytes per weight version: run/lora 1.38 MB" in text
    assert "- LoRA adapter: rank 8, alpha 16, on q_proj, k_proj, v_proj, o_proj, 1.38 MB per version" in text
    tokens = sum(64 * (8 + s % 4) for s in range(20))
    assert f"- generated tokens trained: {tokens:,} (on shared deployment lora: this run's share)" in text
