"""Benchmark figures are generated, not written: every figure emitted lands in its bench's results
file with when and where it was measured; README.md's and docs/benchmarks.md's tables are rendered
from those files (stale ones fail here); and a figure that misses its target fails here unless
bench/results/reasons.toml says why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import results
from bench.common import emit
from tools import gen_bench_table


def test_the_readme_and_benchmarks_tables_are_rendered_from_the_results():
    for path, text in gen_bench_table.rendered().items():
        assert path.read_text() == text, f"{path.name} is stale: run python tools/gen_bench_table.py"


def test_every_figure_meets_its_target_or_says_why_not():
    reasons = results.load_reasons()
    missed = {
        (bench, figure)
        for bench, figure, _, verdict in results.verdicts(results.load())
        if verdict == "missed"
    }
    unexplained = sorted(missed - reasons.keys())
    assert not unexplained, (
        f"figures miss their target with no reason in {results.REASONS.name}: {unexplained}"
    )
    # A reason for a figure that meets its target (or no longer exists) is stale too.
    assert not sorted(reasons.keys() - missed), (
        f"reasons for figures that do not miss: {sorted(reasons.keys() - missed)}"
    )


def copy_results(where):
    """The committed results and reasons, copied to `where`; (bench, figure) of one checked figure."""
    checked = None
    for bench, rows in results.load().items():
        (where / f"{bench}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
        checked = checked or next(
            ((bench, f) for f, r in rows.items() if results.parse_target(r["target"])), None
        )
    if results.REASONS.exists():
        (where / results.REASONS.name).write_text(results.REASONS.read_text())
    assert checked is not None, "no results with a target"
    return checked


def edit_value(where, bench, figure, factor):
    rows = results.read_file(where / f"{bench}.jsonl")
    rows[figure]["value"] = rows[figure]["value"] * factor + 1
    (where / f"{bench}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.values()))


def test_an_edited_figure_makes_the_readme_table_stale(tmp_path):
    bench, figure = copy_results(tmp_path)
    assert gen_bench_table.rendered(tmp_path) == gen_bench_table.rendered()
    edit_value(tmp_path, bench, figure, 2)
    assert gen_bench_table.rendered(tmp_path)[gen_bench_table.README] != gen_bench_table.README.read_text()
    check = [sys.executable, str(gen_bench_table.ROOT / "tools" / "gen_bench_table.py"), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    stale = subprocess.run([*check, "--results", str(tmp_path)], capture_output=True, text=True)
    assert stale.returncode == 1 and "README.md: the benchmark table is stale" in stale.stderr


@pytest.mark.parametrize(
    ("target", "ratio", "value", "checks", "status"),
    [
        (">= 1.3", 1.33, 10.9, "ratio", "met"),
        (">= 1.3", 1.2, 10.9, "ratio", "missed"),
        ("<= 2x", 1.7, 0.1, "ratio", "met"),
        ("< 15 s", 1.1, 9.7, "value", "met"),
        ("< 15 s", 0.9, 16.0, "value", "missed"),
        ("ratio <= 0.5", 0.39, 3.3, "value", "met"),
        ("value < 200", 5.0, 12.0, "ratio", "met"),
        ("last-3 minus first-3 step mean reward > 0.05", None, 0.2, "value", "met"),
        ("0.75..1.25", 1.1, 250.0, "ratio", "met"),
        ("0.75..1.25", 0.7, 250.0, "ratio", "missed"),
        ("0.75..1.25", 1.3, 250.0, "ratio", "missed"),
        ("reference: per-step fixed cost dominates", 0.5, 1.0, "ratio", "reference"),
        ("higher is better", 2.0, 1.0, "ratio", "reference"),
    ],
)
def test_targets_are_checked_on_the_figures_ratio_or_value(target, ratio, value, checks, status):
    row = {"target": target, "ratio": ratio, "value": value, "checks": checks}
    assert results.judge(row, {}) == status


def test_a_target_may_be_met_by_another_figure_of_the_same_bench():
    throughput = {"target": ">= 1.3 (or p99_ratio <= 0.7)", "ratio": 1.1, "value": 1.0, "checks": "ratio"}
    p99 = {"target": "<= 0.7", "ratio": 0.6, "value": 1.0, "checks": "ratio"}
    assert results.judge(throughput, {"p99_ratio": p99}) == "met"
    assert results.judge(throughput, {"p99_ratio": {**p99, "ratio": 0.9}}) == "missed"
    assert results.judge(throughput, {}) == "missed"  # the other figure was not measured


def test_a_quick_run_is_shown_but_not_held_to_the_target():
    row = {"target": ">= 1.3", "ratio": 0.2, "value": 1.0, "checks": "ratio", "quick": True}
    assert results.judge(row, {}) == "quick"


def test_emit_records_the_figure_with_its_provenance_and_spread(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    emit("demo", "speed_ratio", 2.0, 1.0, 2.0, "steps/s", ">= 1.5", samples=[1.8, 2.0, 2.3])
    emit("demo", "lag_ms", 12.0, 100.0, 0.12, "ms", "< 50", checks="value")
    emit("demo", "speed_ratio", 2.2, 1.0, 2.2, "steps/s", ">= 1.5")  # a rerun replaces the line
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["figure"] for p in printed] == ["speed_ratio", "lag_ms", "speed_ratio"]
    assert printed[0]["spread"] == [1.8, 2.3] and printed[0]["repeats"] == 3
    rows = results.read_file(tmp_path / "demo.jsonl")
    assert list(rows) == ["speed_ratio", "lag_ms"] and rows["speed_ratio"]["value"] == 2.2
    for row in rows.values():
        assert row["commit"] and row["date"].endswith("Z") and "CPUs" in row["host"]
        assert isinstance(row["args"], list) and row["quick"] is ("--quick" in row["args"])
    assert rows["lag_ms"]["checks"] == "value" and results.judge(rows["lag_ms"], rows) == "met"


def test_results_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_ENV, "off")
    monkeypatch.chdir(tmp_path)
    emit("demo", "x", 1.0, None, None, "s", "reference")
    assert not list(tmp_path.rglob("*.jsonl"))
