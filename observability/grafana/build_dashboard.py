"""Builds observability/grafana/dashboards/looprl.json, the looprl Grafana dashboard.

The dashboard is generated rather than hand-edited so that every panel has the same shape, the
grid never overlaps, and every query names its datasource by the FIXED uid provisioned in
observability/grafana/provisioning/datasources/datasources.yaml ("prometheus", "tempo").
Rows: the run (reward, loss, tokens/s, staleness, versions per deployment), then one row per
service, then traces. Panels link to the service's traces in Tempo. tests/unit/deploy checks the
committed JSON is what this script writes, that it refers only to provisioned uids and that every
metric it queries is in services/kit/telemetry/metrics.py; tests/e2e/test_metrics_scrape.py checks every
query returns a series from a live stack. Regenerate after an edit:

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
RUN = 'run=~"$run"'


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


def targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    """(expr, legend) pairs as targets A, B, C..."""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def tempo_url(traceql: str) -> str:
    query = traceql.replace('"', '\\"')
    return (
        '/explore?left={"datasource":"tempo","queries":[{"refId":"A","queryType":"traceql",'
        f'"query":"{query}"}}]}}'
    )


TRACE_LINK = {
    "title": "Traces of ${__field.labels.service} in Tempo",
    "url": tempo_url('{resource.service.name="${__field.labels.service}"}'),
}


def service_traces(service: str) -> dict[str, str]:
    """A panel link to one service's traces in Tempo."""
    return {
        "title": f"Traces of {service} in Tempo",
        "url": tempo_url(f'{{resource.service.name="{service}"}}'),
    }


def timeseries(
    grid: Grid,
    title: str,
    queries: list[dict[str, Any]],
    unit: str = "short",
    width: int = 8,
    description: str = "",
    trace_links: bool = False,
    service: str = "",
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}}
    if trace_links:
        defaults["links"] = [TRACE_LINK]
    elif service:
        defaults["links"] = [service_traces(service)]
    return {
        "id": grid.take_id(),
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": PROM,
        "gridPos": grid.place(width, 8),
        "targets": queries,
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


def select(metric: str, selector: str = "") -> str:
    return f"{metric}{{{selector}}}" if selector else metric


def agg(op: str, metric: str, by: str, selector: str = "") -> str:
    """A gauge aggregated: op by (labels) (metric{selector})."""
    return f"{op} by ({by}) ({select(metric, selector)})"


def rate(metric: str, by: str, selector: str = "") -> str:
    return f"sum by ({by}) (rate({select(metric, selector)}[{RATE}]))"


def quantile(q: float, metric: str, by: str, selector: str = "") -> str:
    return (
        f"histogram_quantile({q}, sum by ({by}, le) (rate({select(metric + '_bucket', selector)}[{RATE}])))"
    )


def mean_of(metric: str, by: str, selector: str = "") -> str:
    """Mean of a histogram's observations over the rate window (sum / count)."""
    return f"{rate(metric + '_sum', by, selector)} / {rate(metric + '_count', by, selector)}"


def run_row(g: Grid) -> list[dict[str, Any]]:
    return [
        row(g, "Run"),
        timeseries(
            g,
            "Reward (mean of the step's rollouts)",
            targets((agg("max", "looprl_trainer_reward_mean", "run", RUN), "{{run}}")),
            service="trainer",
        ),
        timeseries(
            g, "Loss", targets((agg("max", "looprl_trainer_loss", "run", RUN), "{{run}}")), service="trainer"
        ),
        timeseries(
            g,
            "Trained tokens/s",
            targets(
                (agg("max", "looprl_trainer_tokens_per_second", "run", RUN), "{{run}}"),
                (rate("looprl_trainer_tokens_total", "run", RUN), "rate {{run}}"),
            ),
            service="trainer",
        ),
        timeseries(
            g,
            "Staleness (policy lag, steps)",
            targets(
                (agg("max", "looprl_trainer_staleness_steps", "run, stat", RUN), "{{stat}} {{run}}"),
                (agg("max", "looprl_packer_staleness_steps", "run", RUN), "packer {{run}}"),
            ),
            service="rollout-packer",
        ),
        timeseries(
            g,
            "Weight version per deployment",
            targets(
                (
                    agg("max", "looprl_weight_sync_deployment_version", "run, deployment", RUN),
                    "{{deployment}}",
                ),
                (agg("max", "looprl_trainer_weight_version", "run", RUN), "trained {{run}}"),
            ),
            service="weight-sync",
        ),
        timeseries(
            g,
            "Steps and runs",
            targets(
                (agg("max", "looprl_gateway_run_step", "run", RUN), "step {{run}}"),
                ("sum by (state) (looprl_gateway_runs)", "runs {{state}}"),
            ),
            service="gateway",
        ),
    ]


def rpc_row(g: Grid) -> list[dict[str, Any]]:
    requests = "looprl_rpc_requests_total"
    errors = rate(requests, "service", f'{SERVICE},code!="OK"')
    return [
        row(g, "RPCs (every service, from the kit interceptor)"),
        timeseries(
            g,
            "Request rate by service",
            targets((rate(requests, "service", SERVICE), "{{service}}")),
            unit="reqps",
            trace_links=True,
        ),
        # `or ... * 0`: a service with no errors shows 0, not a gap.
        timeseries(
            g,
            "Error ratio by service (code != OK)",
            targets(
                (
                    f"({errors} or {rate(requests, 'service', SERVICE)} * 0)"
                    f" / {rate(requests, 'service', SERVICE)}",
                    "{{service}}",
                )
            ),
            unit="percentunit",
            trace_links=True,
        ),
        timeseries(
            g,
            "Latency p50 / p99 by service",
            targets(
                (quantile(0.99, "looprl_rpc_duration_seconds", "service", SERVICE), "p99 {{service}}"),
                (quantile(0.5, "looprl_rpc_duration_seconds", "service", SERVICE), "p50 {{service}}"),
            ),
            unit="s",
            trace_links=True,
        ),
        timeseries(
            g,
            "Requests by method and code",
            targets((rate(requests, "service, method, code", SERVICE), "{{service}} {{method}} {{code}}")),
            unit="reqps",
            width=12,
            trace_links=True,
        ),
        timeseries(
            g,
            "In-flight RPCs",
            targets((f"sum by (service) (looprl_rpc_in_flight{{{SERVICE}}})", "{{service}}")),
            width=12,
        ),
    ]


def gateway_row(g: Grid) -> list[dict[str, Any]]:
    svc = "gateway"
    return [
        row(g, "Gateway"),
        timeseries(
            g,
            "HTTP requests by route and status",
            targets((rate("looprl_gateway_http_requests_total", "route, status"), "{{route}} {{status}}")),
            unit="reqps",
            service=svc,
        ),
        timeseries(
            g,
            "HTTP latency p99 by route",
            targets((quantile(0.99, "looprl_gateway_http_request_seconds", "route"), "{{route}}")),
            unit="s",
            service=svc,
        ),
        timeseries(
            g,
            "OpenAI-compatible requests and tokens/s",
            targets(
                (rate("looprl_gateway_openai_requests_total", "endpoint, status"), "{{endpoint}} {{status}}"),
                (
                    rate("looprl_gateway_openai_tokens_total", "endpoint, kind"),
                    "tokens {{endpoint}} {{kind}}",
                ),
            ),
            service=svc,
        ),
    ]


def trainer_row(g: Grid) -> list[dict[str, Any]]:
    svc = "trainer"
    return [
        row(g, "Trainer"),
        timeseries(
            g,
            "KL and entropy (nats)",
            targets(
                (agg("max", "looprl_trainer_kl", "run", RUN), "kl {{run}}"),
                (agg("max", "looprl_trainer_entropy", "run", RUN), "entropy {{run}}"),
            ),
            service=svc,
        ),
        timeseries(
            g,
            "Gradient norm and clip fraction",
            targets(
                (agg("max", "looprl_trainer_grad_norm", "run", RUN), "grad norm {{run}}"),
                (agg("max", "looprl_trainer_clip_fraction", "run", RUN), "clipped {{run}}"),
            ),
            service=svc,
        ),
        timeseries(
            g,
            "Step seconds by phase (mean)",
            targets((mean_of("looprl_trainer_step_seconds", "run, phase", RUN), "{{phase}} {{run}}")),
            unit="s",
            service=svc,
        ),
        timeseries(
            g,
            "Steps/s",
            targets((rate("looprl_trainer_steps_total", "run", RUN), "{{run}}")),
            service=svc,
            width=12,
        ),
        timeseries(
            g,
            "Checkpoint seconds (p99)",
            targets(
                (quantile(0.99, "looprl_trainer_checkpoint_seconds", "run, kind", RUN), "{{kind}} {{run}}")
            ),
            unit="s",
            service=svc,
            width=12,
        ),
    ]


def weight_sync_row(g: Grid) -> list[dict[str, Any]]:
    svc = "weight-sync"
    return [
        row(g, "Weight-sync"),
        timeseries(
            g,
            "Sync seconds p99 by transport",
            targets(
                (
                    quantile(0.99, "looprl_weight_sync_sync_seconds", "deployment, transport"),
                    "{{deployment}} {{transport}}",
                )
            ),
            unit="s",
            service=svc,
        ),
        timeseries(
            g,
            "Bytes/s delivered by transport, pushed by the trainer",
            targets(
                (
                    rate("looprl_weight_sync_delivered_bytes_total", "transport, host"),
                    "{{transport}} to {{host}}",
                ),
                (rate("looprl_weight_sync_pushed_bytes_total", "run", RUN), "pushed {{run}}"),
            ),
            unit="Bps",
            service=svc,
        ),
        timeseries(
            g,
            "Versions: latest pushed, rejected, failed deliveries",
            targets(
                (agg("max", "looprl_weight_sync_latest_version", "run", RUN), "latest {{run}}"),
                (
                    f"sum by (deployment) (increase(looprl_weight_sync_rejected_versions_total[{RATE}]))",
                    "rejected {{deployment}}",
                ),
                (
                    f"sum by (deployment) (increase(looprl_weight_sync_failed_syncs_total[{RATE}]))",
                    "failed {{deployment}}",
                ),
            ),
            service=svc,
        ),
    ]


def reward_row(g: Grid) -> list[dict[str, Any]]:
    svc = "reward"
    return [
        row(g, "Reward"),
        timeseries(
            g,
            "Mean score by reward",
            targets((mean_of("looprl_reward_score", "reward"), "{{reward}}")),
            service=svc,
        ),
        timeseries(
            g,
            "Scoring latency p99 by reward",
            targets((quantile(0.99, "looprl_reward_seconds", "reward"), "{{reward}}")),
            unit="s",
            service=svc,
        ),
        timeseries(
            g,
            "Failed components by reason",
            targets((rate("looprl_reward_failures_total", "reward, reason"), "{{reward}} {{reason}}")),
            unit="ops",
            service=svc,
        ),
    ]


def router_row(g: Grid) -> list[dict[str, Any]]:
    svc = "inference-router"
    per_replica = "{{deployment}}/{{replica}}"
    return [
        row(g, "Inference router (per deployment)"),
        timeseries(
            g,
            "Generate requests by deployment and outcome",
            targets(
                (rate("looprl_router_requests_total", "deployment, outcome"), "{{deployment}} {{outcome}}")
            ),
            unit="reqps",
            service=svc,
        ),
        timeseries(
            g,
            "Outstanding requests per replica",
            targets(("sum by (deployment, replica) (looprl_router_outstanding_requests)", per_replica)),
            description="Load the router sees on each replica; routing balances on this and on tokens.",
            service=svc,
        ),
        timeseries(
            g,
            "Outstanding tokens per replica",
            targets(("sum by (deployment, replica) (looprl_router_outstanding_tokens)", per_replica)),
            service=svc,
        ),
        timeseries(
            g,
            "Tokens/s by deployment",
            targets((rate("looprl_router_tokens_total", "deployment, kind"), "{{deployment}} {{kind}}")),
            service=svc,
        ),
        timeseries(
            g,
            "Request latency p99 by deployment",
            targets((quantile(0.99, "looprl_router_request_seconds", "deployment"), "{{deployment}}")),
            unit="s",
            service=svc,
        ),
        timeseries(
            g,
            "Routing decisions, retries, rejections",
            targets(
                (
                    rate("looprl_router_decisions_total", "deployment, reason"),
                    "decide {{deployment}} {{reason}}",
                ),
                (rate("looprl_router_retries_total", "deployment"), "retry {{deployment}}"),
                (rate("looprl_router_rejections_total", "reason"), "reject {{reason}}"),
                (quantile(0.99, "looprl_router_decision_seconds", "instance"), "decide p99 s"),
            ),
            unit="ops",
            service=svc,
        ),
        timeseries(
            g,
            "Weight version served per replica",
            targets(("max by (deployment, replica) (looprl_router_replica_weight_version)", per_replica)),
            width=12,
            description="Every replica should step up together after each weights.published event.",
            service=svc,
        ),
        timeseries(
            g,
            "Version spread per deployment (max - min), routable replicas",
            targets(
                (
                    "max by (deployment) (looprl_router_replica_weight_version)"
                    " - min by (deployment) (looprl_router_replica_weight_version)",
                    "{{deployment}}",
                ),
                ("sum by (deployment) (looprl_router_replica_routable)", "routable {{deployment}}"),
            ),
            width=12,
            service=svc,
        ),
    ]


def replica_row(g: Grid) -> list[dict[str, Any]]:
    svc = "inference-replica"
    per_replica = "{{deployment}}/{{replica}}"
    return [
        row(g, "Inference replicas (their own /metrics)"),
        timeseries(
            g,
            "Queued requests and tokens in flight per replica",
            targets(
                ("sum by (deployment, replica) (looprl_replica_queued_requests)", "queued " + per_replica),
                ("sum by (deployment, replica) (looprl_replica_tokens_in_flight)", "tokens " + per_replica),
            ),
            description="What each engine holds, as the replica itself reports it.",
            service=svc,
        ),
        timeseries(
            g,
            "KV cache in use per replica",
            targets(("max by (deployment, replica) (looprl_replica_cache_usage)", per_replica)),
            unit="percentunit",
            service=svc,
        ),
        timeseries(
            g,
            "Serving replicas",
            targets(("sum by (deployment) (looprl_replica_ready)", "{{deployment}}")),
            description="Replicas holding weights and not paused (1 each).",
            service=svc,
        ),
    ]


def packer_row(g: Grid) -> list[dict[str, Any]]:
    svc = "rollout-packer"
    return [
        row(g, "Rollout packer"),
        timeseries(
            g,
            "Padding fraction of the micro-batch budget",
            targets((agg("max", "looprl_packer_padding_fraction", "run", RUN), "{{run}}")),
            unit="percentunit",
            service=svc,
        ),
        timeseries(
            g,
            "DP rank imbalance (max/mean) and sync idle",
            targets(
                (agg("max", "looprl_packer_rank_imbalance", "run", RUN), "imbalance {{run}}"),
                (agg("max", "looprl_packer_sync_idle_fraction", "run", RUN), "idle {{run}}"),
            ),
            service=svc,
        ),
        timeseries(
            g,
            "Lag: queued rollouts, pending groups, unacked steps",
            targets(
                (agg("sum", "looprl_packer_queued_rollouts", "run", RUN), "queued {{run}}"),
                (agg("sum", "looprl_packer_pending_groups", "run", RUN), "pending groups {{run}}"),
                (agg("max", "looprl_packer_unacked_steps", "run", RUN), "unacked steps {{run}}"),
            ),
            service=svc,
        ),
        timeseries(
            g,
            "Rollouts acked vs dropped (by reason)",
            targets(
                (rate("looprl_packer_acked_rollouts_total", "run", RUN), "acked {{run}}"),
                (
                    rate("looprl_packer_dropped_rollouts_total", "run, reason", RUN),
                    "dropped {{run}} {{reason}}",
                ),
            ),
            unit="ops",
            service=svc,
            width=12,
        ),
        timeseries(
            g,
            "Steps planned and plan time p99",
            targets(
                (rate("looprl_packer_steps_planned_total", "run", RUN), "steps/s {{run}}"),
                (quantile(0.99, "looprl_packer_plan_seconds", "run", RUN), "plan p99 s {{run}}"),
            ),
            service=svc,
            width=12,
        ),
    ]


def sandbox_row(g: Grid) -> list[dict[str, Any]]:
    svc = "environment-sandbox"
    return [
        row(g, "Environment sandbox"),
        timeseries(
            g,
            "Sandbox actors (now, peak)",
            targets(
                ("sum(looprl_sandbox_fleet_actors)", "actors"),
                ("max(looprl_sandbox_fleet_peak_actors)", "peak"),
            ),
            service=svc,
            width=12,
        ),
        timeseries(
            g,
            "Sandbox executions/s",
            targets((f"sum(rate(looprl_sandbox_fleet_executions_total[{RATE}]))", "executions")),
            unit="ops",
            service=svc,
            width=12,
        ),
    ]


def traces_row(g: Grid) -> list[dict[str, Any]]:
    def traceql(title: str, query: str, width: int, description: str = "") -> dict[str, Any]:
        return {
            "id": g.take_id(),
            "type": "table",
            "title": title,
            "description": description,
            "datasource": TEMPO,
            "gridPos": g.place(width, 10),
            "targets": [
                {"datasource": TEMPO, "queryType": "traceql", "query": query, "limit": 20, "refId": "A"}
            ],
        }

    return [
        row(g, "Traces (Tempo)"),
        {
            "id": g.take_id(),
            "type": "nodeGraph",
            "title": "Service graph (Tempo metrics generator)",
            "datasource": TEMPO,
            "gridPos": g.place(12, 10),
            "targets": [{"datasource": TEMPO, "queryType": "serviceMap", "refId": "A"}],
        },
        traceql(
            "Recent error traces",
            '{ status = error && resource.service.name =~ "$service" }',
            12,
            "Click a trace id to open it in Tempo.",
        ),
        traceql("Slowest traces (> 1 s)", '{ duration > 1s && resource.service.name =~ "$service" }', 12),
        traceql(
            "Recent trainer steps",
            '{ name = "trainer step" && span.looprl.run_id =~ "$run" }',
            12,
            "One trace per step, linked to the rollouts it trained.",
        ),
    ]


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": PROM,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
    }


def build() -> dict[str, Any]:
    g = Grid()
    panels: list[dict[str, Any]] = []
    for section in (
        run_row,
        rpc_row,
        gateway_row,
        trainer_row,
        weight_sync_row,
        reward_row,
        router_row,
        replica_row,
        packer_row,
        sandbox_row,
        traces_row,
    ):
        panels.extend(section(g))
    return {
        "uid": "looprl-overview",
        "title": "looprl",
        "description": "The run, then every looprl service: RPCs, gateway, trainer, weight-sync, reward, "
        "inference routing, packing, sandboxes; traces in Tempo.",
        "tags": ["looprl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "graphTooltip": 1,
        "links": [
            {"title": "Explore traces", "type": "link", "url": tempo_url("{}"), "icon": "external link"}
        ],
        "templating": {
            "list": [
                variable("service", "label_values(looprl_rpc_requests_total, service)"),
                variable("run", "label_values(looprl_trainer_steps_total, run)"),
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
