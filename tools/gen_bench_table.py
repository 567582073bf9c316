"""Write the benchmark figure tables of README.md and docs/benchmarks.md from bench/results/, or
check they are fresh.

Each table sits between two markers in its page and is replaced whole: README.md lists the figures
that have a target (one line each: figure, value vs baseline, target, met or not), and
docs/benchmarks.md every figure with when and where it was measured. A figure that misses its
target shows the reason given for it in bench/results/reasons.toml. `--check` fails when a page
differs from what the results render (tests/unit/bench/test_results_table.py does the same, and also
fails on a miss without a reason).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench import results

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
START = "<!-- figures:start (tools/gen_bench_table.py writes this table from bench/results/) -->"
END = "<!-- figures:end -->"

STATUS = {"met": "yes", "missed": "**no**", "reference": "reference", "quick": "not checked (--quick run)"}


def number(x: float | None) -> str:
    if x is None:
        return "-"
    magnitude = abs(x)
    if magnitude >= 1000:
        return f"{x:,.0f}"
    if magnitude >= 100:
        return f"{x:.0f}"
    if magnitude >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def short_unit(unit: str) -> str:
    """The unit without its parenthesised explanation (docs/benchmarks.md says what it measures)."""
    return unit.split(" (")[0].split(":")[0].strip()


# Units shown scaled: bytes/s as GB/s.
SCALED = {"bytes/s": ("GB/s", 1e-9)}


def value_vs_baseline(row: dict[str, Any]) -> str:
    unit = short_unit(row["unit"])
    unit, scale = SCALED.get(unit, (unit, 1.0))
    checks = row.get("checks") or results.default_checks(row.get("ratio"))
    value = number(row["value"] * scale)
    if checks == "value":
        value = f"**{value}**"
    text = f"{value} {unit}"
    if row.get("baseline") is not None:
        text = f"{value} vs {number(row['baseline'] * scale)} {unit}"
        if row.get("ratio") is not None:
            ratio = number(row["ratio"])
            text += f" = {f'**{ratio}**' if checks == 'ratio' else ratio}"
    if row.get("spread") and (row.get("repeats") or 0) > 1:
        lo, hi = row["spread"]
        text += f" ({number(lo)}-{number(hi)} over {row['repeats']})"
    return text


def status(verdict: results.Verdict, reason: str | None) -> str:
    text = STATUS[verdict]
    return f"{text}: {reason}" if verdict == "missed" and reason else text


def rows(where: Path, checked_only: bool) -> list[tuple[str, str, dict[str, Any], results.Verdict]]:
    found = list(results.verdicts(results.load(where)))
    return [r for r in found if not checked_only or r[3] != "reference"]


def readme_table(where: Path = results.RESULTS_DIR) -> str:
    reasons = results.load_reasons(where / results.REASONS.name)
    lines = ["| figure | value vs baseline | target | met |", "|---|---|---|---|"]
    hosts = set()
    for bench, figure, row, verdict in rows(where, checked_only=True):
        hosts.add(row.get("host", "unknown"))
        lines.append(
            f"| {bench} `{figure}` | {value_vs_baseline(row)} | {row['target']} | "
            f"{status(verdict, reasons.get((bench, figure)))} |"
        )
    lines += ["", measured_on(hosts)]
    return "\n".join(lines)


def measured_on(hosts: set[str]) -> str:
    return "Measured on: " + "; ".join(sorted(hosts)) + ". In brackets: the spread over the bench's repeats."


def benchmarks_table(where: Path = results.RESULTS_DIR) -> str:
    reasons = results.load_reasons(where / results.REASONS.name)
    lines = [
        "| figure | value vs baseline | target | met | measured |",
        "|---|---|---|---|---|",
    ]
    hosts = set()
    for bench, figure, row, verdict in rows(where, checked_only=False):
        hosts.add(row.get("host", "unknown"))
        args = " ".join(row.get("args") or [])
        measured = f"{row.get('date', '?')[:10]}, {row.get('commit', '?')}" + (f", `{args}`" if args else "")
        lines.append(
            f"| {bench} `{figure}` | {value_vs_baseline(row)} | {row['target']} | "
            f"{status(verdict, reasons.get((bench, figure)))} | {measured} |"
        )
    lines += ["", measured_on(hosts)]
    return "\n".join(lines)


def replace_block(page: str, table: str, where: Path) -> str:
    """The page with the text between the markers replaced by `table`."""
    if START not in page or END not in page:
        raise SystemExit(f"{where}: the markers {START!r} and {END!r} are missing")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def rendered(where: Path = results.RESULTS_DIR) -> dict[Path, str]:
    """Each page as the results in `where` render it."""
    return {
        README: replace_block(README.read_text(), readme_table(where), README),
        BENCHMARKS: replace_block(BENCHMARKS.read_text(), benchmarks_table(where), BENCHMARKS),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page's table is stale")
    parser.add_argument("--results", type=Path, default=results.RESULTS_DIR, help="the results directory")
    args = parser.parse_args()
    pages = rendered(args.results)
    stale = [path for path, text in pages.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(
                f"{path.relative_to(ROOT)}: the benchmark table is stale: run python tools/gen_bench_table.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
