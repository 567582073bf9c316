"""Builds observability/grafana/dashboards/looprl.json, the looprl Grafana dashboard.

The dashboard is generated rather than hand-edited so that every panel has the same shape, the
grid never overlaps, and every query names its datasource by the FIXED uid provisioned in
observability/grafana/provisioning/datasources/datasources.yaml ("prometheus", "tempo").
tests/unit/deploy/test_deploy_observability.py checks the committed JSON is what this script
writes, that it refers only to provisioned uids, and that every looprl_* metric it queries is
defined by some service. Regenerate after an edit:

    .venv/bin/python observability/grafana/build_dashboard.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "looprl.json"
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}
RATE = "$__rate_interval"
SERVICE = 'service=~"$service"'


class Grid:
    """Places panels left to right on a 24-column grid, wrapping rows."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, width: int, height: int) -> dict[str, int]:
        if self.x + width > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        pos = {"x": self.x, "y": self.y, "w": width, "h": height}
        self.x += width
        self.row_height = max(self.row_height, height)
        return pos

    def new_row(self) -> dict[str, int]:
        self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        pos = {"x": 0, "y": self.y, "w": 24, "h": 1}
        self.y += 1
        return pos

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str, ref: str = "A") -> dict[str, Any]:
    return {"datasource": PROM, "expr": expr, "legendFormat": legend, "refId": ref, "exemplar": True}


TRACE_LINK = {
    "title": "Traces of ${__field.labels.service} in Tempo",
    "url": (
        '/explore?left={"datasource":"tempo","queries":[{"refId":"A","queryType":"traceql",'
        '"query":"{resource.service.name=\\"${__field.labels.service}\\"}"}]}'
    ),
}


def timeseries(
    grid: Grid,
    title: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    width: int = 8,
    description: str = "",
    trace_links: bool = False,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}}
    if trace_links:
        defaults["links"] = [TRACE_LINK]
    return {
        "id": grid.take_id(),
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": PROM,
        "gridPos": grid.place(width, 8),
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def row(grid: Grid, title: str) -> dict[str, Any]:
    return {
        "id": grid.take_id(),
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": grid.new_row(),
        "panels": [],
    }


def build() -> dict[str, Any]:
    g = Grid()
    panels: list[dict[str, Any]] = []

    panels.append(row(g, "RPCs (every service, from the kit interceptor)"))
    panels.append(
        timeseries(
            g,
            "Request rate by service",
            [
                target(
                    f"sum by (service) (rate(looprl_rpc_requests_total{{{SERVICE}}}[{RATE}]))", "{{service}}"
                )
            ],
            unit="reqps",
            trace_links=True,
        )
    )
    panels.append(
        timeseries(
            g,
            "Error ratio by service (code != OK)",
            [
                target(
                    f'sum by (service) (rate(looprl_rpc_requests_total{{{SERVICE},code!="OK"}}[{RATE}]))'
                    f" / sum by (service) (rate(looprl_rpc_requests_total{{{SERVICE}}}[{RATE}]))",
                    "{{service}}",
                )
            ],
            unit="percentunit",
            trace_links=True,
        )
    )
    panels.append(
        timeseries(
            g,
            "Latency p50 / p99 by service",
            [
                target(
                    "histogram_quantile(0.99, sum by (service, le) "
                    f"(rate(looprl_rpc_duration_seconds_bucket{{{SERVICE}}}[{RATE}])))",
                    "p99 {{service}}",
                ),
                target(
                    "histogram_quantile(0.5, sum by (service, le) "
                    f"(rate(looprl_rpc_duration_seconds_bucket{{{SERVICE}}}[{RATE}])))",
                    "p50 {{service}}",
                    "B",
                ),
            ],
            unit="s",
            trace_links=True,
        )
    )
    panels.append(
        timeseries(
            g,
            "Errors by method and code",
            [
                target(
                    f'sum by (service, method, code) (rate(looprl_rpc_requests_total{{{SERVICE},code!="OK"}}[{RATE}]))',
                    "{{service}} {{method}} {{code}}",
                )
            ],
            unit="reqps",
            width=12,
            trace_links=True,
        )
    )
    panels.append(
        timeseries(
            g,
            "In-flight RPCs",
            [target(f"sum by (service) (looprl_rpc_in_flight{{{SERVICE}}})", "{{service}}")],
            width=12,
        )
    )

    panels.append(row(g, "Inference router (per deployment)"))
    panels.append(
        timeseries(
            g,
            "Generate requests by deployment and outcome",
            [
                target(
                    f"sum by (deployment, outcome) (rate(looprl_router_requests_total[{RATE}]))",
                    "{{deployment}} {{outcome}}",
                )
            ],
            unit="reqps",
        )
    )
    panels.append(
        timeseries(
            g,
            "Outstanding requests per replica",
            [
                target(
                    "sum by (deployment, replica) (looprl_router_outstanding_requests)",
                    "{{deployment}}/{{replica}}",
                )
            ],
            description="Load the router sees on each replica; routing balances on this and on tokens.",
        )
    )
    panels.append(
        timeseries(
            g,
            "Outstanding tokens per replica",
            [
                target(
                    "sum by (deployment, replica) (looprl_router_outstanding_tokens)",
                    "{{deployment}}/{{replica}}",
                )
            ],
        )
    )
    panels.append(
        timeseries(
            g,
            "Tokens/s by deployment",
            [
                target(
                    f"sum by (deployment, kind) (rate(looprl_router_tokens_total[{RATE}]))",
                    "{{deployment}} {{kind}}",
                )
            ],
        )
    )
    panels.append(
        timeseries(
            g,
            "Request latency p99 by deployment",
            [
                target(
                    f"histogram_quantile(0.99, sum by (deployment, le) (rate(looprl_router_request_seconds_bucket[{RATE}])))",
                    "{{deployment}}",
                )
            ],
            unit="s",
        )
    )
    panels.append(
        timeseries(
            g,
            "Routing decisions, retries, rejections",
            [
                target(
                    f"sum by (deployment, reason) (rate(looprl_router_decisions_total[{RATE}]))",
                    "decide {{deployment}} {{reason}}",
                ),
                target(
                    f"sum by (deployment) (rate(looprl_router_retries_total[{RATE}]))",
                    "retry {{deployment}}",
                    "B",
                ),
                target(
                    f"sum by (reason) (rate(looprl_router_rejections_total[{RATE}]))",
                    "reject {{reason}}",
                    "C",
                ),
            ],
            unit="ops",
        )
    )

    panels.append(row(g, "Weight versions"))
    panels.append(
        timeseries(
            g,
            "Weight version served per replica",
            [
                target(
                    "max by (deployment, replica) (looprl_router_replica_weight_version)",
                    "{{deployment}}/{{replica}}",
                )
            ],
            width=12,
            description="Every replica should step up together after each weights.published event.",
        )
    )
    panels.append(
        timeseries(
            g,
            "Version spread per deployment (max - min)",
            [
                target(
                    "max by (deployment) (looprl_router_replica_weight_version)"
                    " - min by (deployment) (looprl_router_replica_weight_version)",
                    "{{deployment}}",
                ),
                target(
                    "sum by (deployment) (looprl_router_replica_routable)", "routable {{deployment}}", "B"
                ),
            ],
            width=12,
        )
    )

    panels.append(row(g, "Rollout packer"))
    panels.append(
        timeseries(
            g,
            "Padding fraction of the micro-batch budget",
            [target("max by (run) (looprl_packer_padding_fraction)", "{{run}}")],
            unit="percentunit",
        )
    )
    panels.append(
        timeseries(
            g,
            "DP rank imbalance (max/mean) and sync idle",
            [
                target("max by (run) (looprl_packer_rank_imbalance)", "imbalance {{run}}"),
                target("max by (run) (looprl_packer_sync_idle_fraction)", "idle {{run}}", "B"),
            ],
        )
    )
    panels.append(
        timeseries(
            g,
            "Rollouts: queued, pending groups",
            [
                target("sum by (run) (looprl_packer_queued_rollouts)", "queued {{run}}"),
                target("sum by (run) (looprl_packer_pending_groups)", "pending groups {{run}}", "B"),
            ],
        )
    )
    panels.append(
        timeseries(
            g,
            "Rollouts acked vs dropped (by reason)",
            [
                target(f"sum by (run) (rate(looprl_packer_acked_rollouts_total[{RATE}]))", "acked {{run}}"),
                target(
                    f"sum by (run, reason) (rate(looprl_packer_dropped_rollouts_total[{RATE}]))",
                    "dropped {{run}} {{reason}}",
                    "B",
                ),
            ],
            unit="ops",
        )
    )
    panels.append(
        timeseries(
            g,
            "Steps planned and plan time p99",
            [
                target(f"sum by (run) (rate(looprl_packer_steps_planned_total[{RATE}]))", "steps/s {{run}}"),
                target(
                    f"histogram_quantile(0.99, sum by (run, le) (rate(looprl_packer_plan_seconds_bucket[{RATE}])))",
                    "plan p99 s {{run}}",
                    "B",
                ),
            ],
        )
    )

    panels.append(row(g, "Traces (Tempo)"))
    panels.append(
        {
            "id": g.take_id(),
            "type": "nodeGraph",
            "title": "Service graph (Tempo metrics generator)",
            "datasource": TEMPO,
            "gridPos": g.place(12, 10),
            "targets": [{"datasource": TEMPO, "queryType": "serviceMap", "refId": "A"}],
        }
    )
    panels.append(
        {
            "id": g.take_id(),
            "type": "table",
            "title": "Recent error traces",
            "description": "Click a trace id to open it in Tempo.",
            "datasource": TEMPO,
            "gridPos": g.place(12, 10),
            "targets": [
                {
                    "datasource": TEMPO,
                    "queryType": "traceql",
                    "query": '{ status = error && resource.service.name =~ "$service" }',
                    "limit": 20,
                    "refId": "A",
                }
            ],
        }
    )
    panels.append(
        {
            "id": g.take_id(),
            "type": "table",
            "title": "Slowest traces (> 1 s)",
            "datasource": TEMPO,
            "gridPos": g.place(24, 10),
            "targets": [
                {
                    "datasource": TEMPO,
                    "queryType": "traceql",
                    "query": '{ duration > 1s && resource.service.name =~ "$service" }',
                    "limit": 20,
                    "refId": "A",
                }
            ],
        }
    )

    return {
        "uid": "looprl-overview",
        "title": "looprl",
        "description": "RPCs of every looprl service, inference routing, weight versions, packing, traces.",
        "tags": ["looprl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "graphTooltip": 1,
        "links": [
            {
                "title": "Explore traces",
                "type": "link",
                "url": '/explore?left={"datasource":"tempo","queries":[{"refId":"A","queryType":"traceql","query":"{}"}]}',
                "icon": "external link",
            }
        ],
        "templating": {
            "list": [
                {
                    "name": "service",
                    "label": "service",
                    "type": "query",
                    "datasource": PROM,
                    "query": {
                        "query": "label_values(looprl_rpc_requests_total, service)",
                        "refId": "service",
                    },
                    "definition": "label_values(looprl_rpc_requests_total, service)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                    "refresh": 2,
                    "sort": 1,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
