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

from services.kit.config import registry
from services.kit.telemetry.metrics import BY_NAME, CATALOG, SERIES, render_markdown
from tests.support.dashboard_queries import (
    EXTERNAL_METRIC_PREFIXES,
    load,
    metric_names,
    promql,
    walk,
)

ROOT = Path(__file__).resolve().parents[3]
OBS = ROOT / "observability"
DASHBOARDS = sorted((OBS / "grafana/dashboards").glob("*.json"))
STACK = {s.name: s.package for s in registry.SERVICES}  # name -> package
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def provisioned_datasources() -> dict[str, str]:
    spec = yaml.safe_load((OBS / "grafana/provisioning/datasources/datasources.yaml").read_text())
    return {d["uid"]: d["type"] for d in spec["datasources"]}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


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


def test_dashboard_queries_only_metrics_of_the_one_table():
    used = {name for query in promql(load()) for name in metric_names(query)}
    assert "looprl_rpc_requests_total" in used and "looprl_rpc_duration_seconds_bucket" in used
    unknown = {m for m in used if m not in SERIES and not m.startswith(EXTERNAL_METRIC_PREFIXES)}
    assert not unknown, (
        f"dashboard queries metrics not in services/kit/telemetry/metrics.py: {sorted(unknown)}"
    )


def test_every_service_has_a_row_and_every_row_links_to_its_traces():
    dashboard = load()
    services = {m.service for m in CATALOG} - {"every"}
    row_titles = [p["title"].lower() for p in dashboard["panels"] if p["type"] == "row"]
    for service in services:
        words = service.replace("-", " ").split()
        assert any(all(w in title or w.rstrip("s") in title for w in words) for title in row_titles), (
            f"no dashboard row for {service}"
        )
    linked = {
        re.search(r'service.name=\\"([^"\\]+)', link["url"]).group(1)
        for p in panels(dashboard)
        for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])
        if "service.name" in link["url"]
    }
    assert services <= linked, f"no trace link for {sorted(services - linked)}"


def test_run_row_shows_reward_loss_throughput_staleness_and_versions():
    top = load()["panels"]
    assert top[0]["type"] == "row" and top[0]["title"] == "Run", "the run row comes first"
    end = next(i for i, p in enumerate(top[1:], 1) if p["type"] == "row")
    run_panels = top[1:end]
    exprs = " ".join(t["expr"] for p in run_panels for t in p["targets"])
    for metric in (
        "looprl_trainer_reward_mean",
        "looprl_trainer_loss",
        "looprl_trainer_tokens_per_second",
        "looprl_trainer_staleness_steps",
        "looprl_weight_sync_deployment_version",
    ):
        assert metric in exprs, f"the run row does not show {metric}"


def test_metrics_are_created_only_from_the_table_and_every_entry_is_created():
    """No service defines a Prometheus metric of its own; every catalog entry is made by some module."""
    made: set[str] = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "gateway").rglob("*.py")]:
        if path.name == "metric_names.py" or "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
                continue
            called = getattr(node.func, "id", getattr(node.func, "attr", ""))
            assert called not in ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"), (
                f"{path.relative_to(ROOT)}: a metric defined outside services/kit/telemetry/metrics.py"
            )
            if called in ("counter", "gauge", "histogram"):
                made.add(node.args[0].value)
    missing = {m.name for m in CATALOG} - made
    assert not missing, f"in the catalog but exported by no service: {sorted(missing)}"


def test_metric_names_follow_prometheus_conventions():
    for m in CATALOG:
        assert re.fullmatch(r"looprl_[a-z0-9_]+", m.name), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), f"{m.name}: _total is for counters only"
        assert not re.search(r"_(ms|milliseconds|sec|secs|kb|mb|percent)(_|$)", m.name), (
            f"{m.name}: base units"
        )
        if m.unit == "seconds":
            assert "_seconds" in m.name, f"{m.name}: a time in seconds says so in its name"
        assert m.help and m.unit, m.name
    assert len(BY_NAME) == len(CATALOG), "a metric name appears twice"


def test_metrics_doc_is_rendered_from_the_table():
    assert (ROOT / "docs/metrics.md").read_text() == render_markdown(), (
        "stale docs/metrics.md: .venv/bin/python -m services.kit.telemetry.metrics > docs/metrics.md"
    )


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
