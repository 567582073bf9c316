"""The PromQL of the committed Grafana dashboard, and the metric names each query reads.

Shared by the dashboard's unit tests (names must be in services/kit/telemetry/metrics.py) and the
live-scrape test (every query must return a series from a running stack)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "observability" / "grafana" / "dashboards" / "looprl.json"
# Metrics produced outside looprl code that dashboards may use (Tempo's metrics generator).
EXTERNAL_METRIC_PREFIXES = ("traces_",)
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "max",
    "min",
    "avg",
    "count",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "topk",
    "bottomk",
    "le",
    "label_values",
    "offset",
    "bool",
    "abs",
    "clamp_min",
    "clamp_max",
    "delta",
    "deriv",
}
# What Grafana substitutes for the dashboard's variables, for running its queries elsewhere.
VARIABLES = {"$__rate_interval": "30s", "$service": ".*", "$run": ".*"}


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def walk(node: Any, key: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, key)


def promql(dashboard: dict[str, Any]) -> list[str]:
    """Every Prometheus query: panel targets and the Prometheus-backed template variables."""
    queries = [t["expr"] for t in walk(dashboard, "targets") for t in t if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("datasource", {}).get("type") == "prometheus":
            queries.append(variable["query"]["query"])
    return queries


def runnable(query: str) -> str:
    """The query as Prometheus can evaluate it: variables substituted, label_values(m, l) as m."""
    label_values = re.fullmatch(r"\s*label_values\(\s*([^,)]+)\s*,[^)]*\)\s*", query)
    if label_values:
        query = label_values.group(1)
    for name, value in VARIABLES.items():
        query = query.replace(name, value)
    return query


def metric_names(expr: str) -> set[str]:
    expr = runnable(expr)
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    tokens = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr))
    by_labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        by_labels |= {t.strip() for t in group.split(",")}
    return {t for t in tokens - PROMQL_WORDS - by_labels if not t.startswith("$")}
