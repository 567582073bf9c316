"""Shared helpers for benchmarks: timing, percentiles, and the one-JSON-line-per-figure output."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from bench import results


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """Common flags: --quick for a smaller size (CI, smoke runs)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a fast smoke run")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def timed(fn: Callable[[], Any], repeat: int = 1, warmup: int = 1) -> list[float]:
    """Seconds per call of fn, after `warmup` untimed calls (first touch of memory is slow here)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def emit(
    bench: str,
    figure: str,
    value: float,
    baseline: float | None,
    ratio: float | None,
    unit: str,
    target: str,
    *,
    checks: Literal["ratio", "value"] | None = None,
    samples: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Print one figure as the JSON line every benchmark ends with, record it in the bench's
    results file (bench/results.py), and return it.

    `target` is checked against the figure's ratio, or its value with `checks="value"` (the value
    when it has no ratio); `samples` are that quantity's per-repeat values (per seed, per round),
    recorded as the figure's spread."""
    record = {
        "bench": bench,
        "figure": figure,
        "value": _round(value),
        "baseline": _round(baseline),
        "ratio": _round(ratio),
        "unit": unit,
        "target": target,
        "checks": checks or results.default_checks(ratio),
        **results.spread(samples),
    }
    print(json.dumps(record), flush=True)
    results.record(record)
    return record


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")
