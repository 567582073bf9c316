"""observability/: the Grafana dashboard, its datasources, Prometheus targets and the trace pipeline.

The dashboard may refer only to the provisioned datasource uids and only to metrics some service
defines (so a renamed metric breaks a test, not a panel at 3 a.m.); Prometheus must scrape every
service on the port it serves /metrics on; spans must have a path from the services to Tempo.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import yaml

from gateway.stack import SERVICES

ROOT = Path(__file__).resolve().parents[3]
OBS = ROOT / "observability"
DASHBOARDS = sorted((OBS / "grafana/dashboards").glob("*.json"))
STACK = {entry[0]: entry[1] for entry in SERVICES}
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# Metrics produced outside looprl code that dashboards may use (Tempo's metrics generator).
EXTERNAL_METRIC_PREFIXES = ("traces_",)
PROMQL_WORDS = {
    "sum", "by", "rate", "irate", "increase", "histogram_quantile", "max", "min", "avg", "count",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "topk", "bottomk",
    "le", "label_values", "offset", "bool", "abs", "clamp_min", "clamp_max", "delta", "deriv",
}  # fmt: skip


def provisioned_datasources() -> dict[str, str]:
    spec = yaml.safe_load((OBS / "grafana/provisioning/datasources/datasources.yaml").read_text())
    return {d["uid"]: d["type"] for d in spec["datasources"]}


def defined_metrics() -> set[str]:
    """Names passed to prometheus_client Counter/Gauge/Histogram/Summary anywhere in our code."""
    names: set[str] = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "gateway").rglob("*.py")]:
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", ""))
                in ("Counter", "Gauge", "Histogram", "Summary")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                kind, name = getattr(node.func, "id", getattr(node.func, "attr", "")), node.args[0].value
                names.add(name)
                if kind == "Counter" and not name.endswith("_total"):
                    names.add(name + "_total")
                if kind in ("Histogram", "Summary"):
                    names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def walk(node, key: str):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, key)


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def metric_names(expr: str) -> set[str]:
    label_values = re.fullmatch(r"\s*label_values\(\s*([^,)]+)\s*,[^)]*\)\s*", expr)
    if label_values:  # Grafana's label_values(metric, label): only the metric is a metric
        expr = label_values.group(1)
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    tokens = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr))
    by_labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        by_labels |= {t.strip() for t in group.split(",")}
    return {t for t in tokens - PROMQL_WORDS - by_labels if not t.startswith("$")}


def test_there_is_a_dashboard():
    assert [p.name for p in DASHBOARDS] == ["looprl.json"]


def test_committed_dashboard_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("build_dashboard", OBS / "grafana/build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (OBS / "grafana/dashboards/looprl.json").read_text() == module.render(), (
        "stale dashboard: run .venv/bin/python observability/grafana/build_dashboard.py"
    )


def test_datasources_have_the_fixed_uids_and_link_traces_and_metrics():
    sources = provisioned_datasources()
    assert sources == {"prometheus": "prometheus", "tempo": "tempo"}
    spec = yaml.safe_load((OBS / "grafana/provisioning/datasources/datasources.yaml").read_text())
    by_uid = {d["uid"]: d for d in spec["datasources"]}
    assert by_uid["tempo"]["jsonData"]["serviceMap"]["datasourceUid"] == "prometheus"
    assert by_uid["tempo"]["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "tempo"
    # Datasource URLs name compose services on their container ports.
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and "prometheus" in COMPOSE["services"]
    assert by_uid["tempo"]["url"] == "http://tempo:3200" and "tempo" in COMPOSE["services"]


def test_dashboards_refer_only_to_provisioned_datasource_uids():
    sources = provisioned_datasources()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        refs = list(walk(dashboard, "datasource"))
        assert refs, "no datasource references at all"
        for ref in refs:
            assert isinstance(ref, dict), f"{path.name}: datasource given by name ({ref!r}), not by uid"
            assert ref["uid"] in sources, f"{path.name}: unknown datasource uid {ref['uid']!r}"
            assert ref["type"] == sources[ref["uid"]]
        for url in walk(dashboard, "url"):
            if "datasource" in url:
                assert re.findall(r'"datasource":"([^"]+)"', url) and all(
                    uid in sources for uid in re.findall(r'"datasource":"([^"]+)"', url)
                ), url


def test_dashboard_queries_only_metrics_the_code_defines():
    defined = defined_metrics()
    assert "looprl_rpc_requests_total" in defined and "looprl_rpc_duration_seconds_bucket" in defined
    used: set[str] = set()
    for path in DASHBOARDS:
        for expr in walk(json.loads(path.read_text()), "expr"):
            used |= metric_names(expr)
        for query in walk(json.loads(path.read_text()), "query"):
            if isinstance(query, dict):
                used |= metric_names(query["query"])
    assert used, "no PromQL found"
    unknown = {m for m in used if m not in defined and not m.startswith(EXTERNAL_METRIC_PREFIXES)}
    assert not unknown, f"dashboard queries metrics no service defines: {sorted(unknown)}"


def test_metric_name_extraction_sees_through_promql():
    expr = 'histogram_quantile(0.99, sum by (service, le) (rate(looprl_rpc_duration_seconds_bucket{service=~"$service"}[$__rate_interval])))'
    assert metric_names(expr) == {"looprl_rpc_duration_seconds_bucket"}
    assert metric_names("max by (deployment) (a_metric) - min by (deployment) (b_metric)") == {
        "a_metric",
        "b_metric",
    }


def test_dashboard_covers_every_area_and_links_to_traces():
    dashboard = json.loads((OBS / "grafana/dashboards/looprl.json").read_text())
    exprs = " ".join(walk(dashboard, "expr"))
    for metric in (
        "looprl_rpc_requests_total",
        "looprl_rpc_duration_seconds_bucket",
        "looprl_rpc_in_flight",
        "looprl_router_outstanding_requests",
        "looprl_router_replica_weight_version",
        "looprl_packer_padding_fraction",
        "looprl_packer_rank_imbalance",
    ):
        assert metric in exprs, f"no panel shows {metric}"
    tempo_panels = [p for p in panels(dashboard) if p.get("datasource", {}).get("uid") == "tempo"]
    assert any(t.get("queryType") == "serviceMap" for p in tempo_panels for t in p["targets"])
    assert any(t.get("queryType") == "traceql" for p in tempo_panels for t in p["targets"])
    links = [link["url"] for link in walk(dashboard, "links") for link in link]
    assert any('"datasource":"tempo"' in url for url in links), "no link from metrics to traces"


def test_panels_do_not_overlap_and_have_unique_ids():
    dashboard = json.loads((OBS / "grafana/dashboards/looprl.json").read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))


def test_dashboard_provider_loads_the_directory_grafana_mounts():
    provider = yaml.safe_load((OBS / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = dict(v.split(":")[:2][::-1] for v in COMPOSE["services"]["grafana"]["volumes"])
    assert mounts[path] == "./observability/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./observability/grafana/provisioning"


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    config = yaml.safe_load((OBS / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"]), "duplicate job names"
    for name in STACK:
        env = COMPOSE["services"][name]["environment"]
        targets = [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]
        assert targets == [f"{name}:{env['LOOPRL_METRICS_PORT']}"], f"{name}: scraped at {targets}"
        # A target label called `service` would clash with the services' own `service` label.
        assert all("service" not in sc.get("labels", {}) for sc in jobs[name]["static_configs"])
    for name in ("otel-collector", "tempo"):
        assert name in jobs
    prometheus = COMPOSE["services"]["prometheus"]
    assert "--web.enable-remote-write-receiver" in prometheus["command"], (
        "Tempo's metrics generator writes here"
    )


def test_spans_flow_from_the_collector_to_tempo():
    collector = yaml.safe_load((OBS / "otel-collector/config.yaml").read_text())
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert pipeline["processors"][0] == "memory_limiter", "memory_limiter must run first"
    (exporter,) = pipeline["exporters"]
    tempo = yaml.safe_load((OBS / "tempo/tempo.yaml").read_text())
    tempo_port = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[-1]
    assert collector["exporters"][exporter]["endpoint"] == f"tempo:{tempo_port}"
    remote = tempo["metrics_generator"]["storage"]["remote_write"][0]["url"]
    assert remote.startswith("http://prometheus:9090/")
    assert "service-graphs" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]
    # The collector's health_check extension is what stands in for its missing container check.
    assert collector["service"]["extensions"] == ["health_check"]
    label = COMPOSE["services"]["otel-collector"]["labels"]["looprl.healthcheck"]
    assert collector["extensions"]["health_check"]["endpoint"].endswith(":13133") and "13133" in label
