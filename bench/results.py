"""Benchmark results: where each figure is kept, and whether it meets its target.

Every figure a benchmark emits (bench/common.py `emit`) is also written to
`bench/results/<bench>.jsonl`, one line per figure, replacing that figure's previous line: the JSON
line the bench prints plus the commit, date, host and command line it was measured with, and the
spread over the bench's repeats where it has them. The files are committed; their history is the
figures' history. `tools/gen_bench_table.py` renders the tables of README.md and docs/benchmarks.md
from them, and tests/unit/bench/test_results_table.py fails when a table is stale or a figure misses
its target without a reason in `bench/results/reasons.toml`.

A target is text a reader understands and this module checks: one or more clauses joined by "or",
each `[subject] OP NUMBER` (OP one of >=, <=, >, <) or `[subject] LOW..HIGH` (both bounds
included), e.g. ">= 1.3", "<= 2x", "< 15 s", ">= 1.3 (or p99_ratio <= 0.7)", "0.75..1.25". The subject is the figure's ratio, its value, or another figure of
the same bench by name; without one it is whatever the figure's `checks` says (its ratio when it has
one, else its value). A target without a clause ("reference", "higher is better") is not checked.
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REASONS = RESULTS_DIR / "reasons.toml"
# Where emit writes results: a directory, or "off" to write none (default: bench/results/).
RESULTS_ENV = "LOOPRL_BENCH_RESULTS"

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_NUMBER = r"-?\d+(?:\.\d+)?"
_CLAUSE = re.compile(
    r"(?:\b(?P<subject>[A-Za-z_][A-Za-z0-9_]*)\s+)?"
    rf"(?:(?P<low>{_NUMBER})\s*\.\.\s*(?P<high>{_NUMBER})|(?P<op>>=|<=|>|<)\s*(?P<number>{_NUMBER}))"
)


@dataclass(frozen=True)
class Clause:
    subject: str  # "ratio", "value", another figure's name, or "" for the figure's own `checks`
    op: str  # one of _OPS, or ".." for a range
    number: float  # the bound, or a range's low end
    high: float | None = None  # a range's high end

    def holds(self, quantity: float) -> bool:
        if self.high is not None:
            return self.number <= quantity <= self.high
        return _OPS[self.op](quantity, self.number)


def parse_target(target: str) -> list[Clause]:
    """The checkable clauses of a target (any one met meets it); [] when it is only a reference."""
    clauses = []
    for match in _CLAUSE.finditer(target):
        subject = match["subject"] or ""
        if match["low"] is not None:
            clauses.append(Clause(subject, "..", float(match["low"]), float(match["high"])))
        else:
            clauses.append(Clause(subject, match["op"], float(match["number"])))
    return clauses


def default_checks(ratio: float | None) -> str:
    return "ratio" if ratio is not None else "value"


def checked_quantity(record: dict[str, Any], subject: str = "") -> float | None:
    """The number a target clause compares: the record's ratio or value."""
    key = (
        subject
        if subject in ("ratio", "value")
        else record.get("checks") or default_checks(record.get("ratio"))
    )
    return record.get(key)


# A figure's standing against its target.
Verdict = Literal["met", "missed", "reference", "quick"]


def judge(record: dict[str, Any], same_bench: dict[str, dict[str, Any]]) -> Verdict:
    """Whether a figure meets its target: "met", "missed", "reference" (no checkable target) or
    "quick" (a --quick run's figure, not held to the target: its sizes are not the ones the target
    is for). `same_bench` maps the bench's figures by name, for a clause that names another one."""
    clauses = parse_target(record["target"])
    if not clauses:
        return "reference"
    if record.get("quick"):
        return "quick"
    for clause in clauses:
        # A subject with an underscore names a figure of the bench ("p99_ratio <= 0.7"); another word
        # before the comparison ("mean reward > 0.05") is prose, and the clause is about this figure.
        other = None
        if "_" in clause.subject:
            other = same_bench.get(clause.subject)
            if other is None:
                continue  # that figure was not measured
        quantity = checked_quantity(other or record, "" if other else clause.subject)
        if quantity is not None and clause.holds(quantity):
            return "met"
    return "missed"


# ---- writing ------------------------------------------------------------------------------------


def results_dir() -> Path | None:
    where = os.environ.get(RESULTS_ENV, "")
    if where == "off":
        return None
    return Path(where) if where else RESULTS_DIR


@functools.cache
def provenance() -> dict[str, Any]:
    """Commit, date, host and command line of this bench process (computed once, at its first
    figure, so every figure of a run carries the same)."""
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host_description(),
        "args": sys.argv[1:],
        "quick": "--quick" in sys.argv[1:],
    }


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown"
    # Results being written are not what makes the tree dirty.
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return f"{head}+dirty" if dirty else head


def host_description() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{model or 'unknown CPU'}, {os.cpu_count()} CPUs{memory}"


def spread(samples: Sequence[float] | None) -> dict[str, Any]:
    """min and max of the per-repeat values, and how many there were."""
    if not samples:
        return {"spread": None, "repeats": None}
    return {"spread": [_round(min(samples)), _round(max(samples))], "repeats": len(samples)}


def record(figure: dict[str, Any]) -> Path | None:
    """Write one emitted figure, with this run's provenance, into its bench's results file
    (replacing the figure's previous line); the file, or None where results are off."""
    where = results_dir()
    if where is None:
        return None
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{figure['bench']}.jsonl"
    rows = read_file(path)
    rows[figure["figure"]] = {**figure, **provenance()}
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    tmp.replace(path)
    return path


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")


# ---- reading ------------------------------------------------------------------------------------


def read_file(path: Path) -> dict[str, dict[str, Any]]:
    """figure name -> record of one results file, in file order ({} when there is none)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["figure"]: row for row in rows}


def load(where: Path = RESULTS_DIR) -> dict[str, dict[str, dict[str, Any]]]:
    """bench -> figure -> record, every results file in `where`, benches in name order."""
    return {path.stem: read_file(path) for path in sorted(where.glob("*.jsonl"))}


def load_reasons(path: Path = REASONS) -> dict[tuple[str, str], str]:
    """(bench, figure) -> why the figure misses its target, from the reasons file: one TOML table
    per bench, `figure = "reason"`."""
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    return {(bench, figure): reason for bench, figures in data.items() for figure, reason in figures.items()}


def verdicts(
    results: dict[str, dict[str, dict[str, Any]]],
) -> Iterable[tuple[str, str, dict[str, Any], Verdict]]:
    """(bench, figure, record, verdict) for every figure."""
    for bench, figures in results.items():
        for name, row in figures.items():
            yield bench, name, row, judge(row, figures)
