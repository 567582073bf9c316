"""Metrics against a live stack: a short real run, every service's /metrics scraped.

Every metric the dashboard queries must be in some service's scrape with at least one series, each
scrape must pass `promtool check metrics`, and, with a real Prometheus scraping the services during
the run, every dashboard query must return a series. Prometheus and promtool come from PATH or
Debian's `prometheus` package (installed here when running as root with apt); without them the
scrapes are parsed in Python only and the test says what it skipped.

The stack is one of its own, traced to a span log (so exemplars can be checked against recorded
traces): the shared `stack` fixture is for tests that start no run (a stack serves one run, and
other tests rely on it having served none), and it is not traced.
"""

from __future__ import annotations

import json
import time
import urllib.request
import warnings

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.kit.telemetry.metrics import BY_NAME, SERIES
from tests.support import prometheus
from tests.support.dashboard_queries import EXTERNAL_METRIC_PREFIXES, load, metric_names, promql, runnable
from tests.support.runs import run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE, local_stack

pytestmark = pytest.mark.slow

STEPS = 6


def scrape(port: int | str) -> str:
    """/metrics at a port of 127.0.0.1, or at host:port."""
    address = port if isinstance(port, str) else f"127.0.0.1:{port}"
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def replica_targets(router_metrics_port: int) -> list[dict]:
    """The replicas' scrape targets, as Prometheus discovers them (the router's /targets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{router_metrics_port}/targets", timeout=10) as reply:
        return json.loads(reply.read())


def samples(exposition: str) -> dict[str, list]:
    """Sample name -> its samples, as Prometheus would ingest them."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def in_table(sample_name: str) -> bool:
    """A sample of a metric in the table (a counter's or histogram's _created included)."""
    base = sample_name.removesuffix("_created")
    return sample_name in SERIES or (base != sample_name and (base in BY_NAME or f"{base}_total" in BY_NAME))


def total(found: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def openai_completion(stack, model: str) -> dict:
    """A completion from the run's policy, selected by run id as a user of /v1/models would."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.state.http_port}/v1/completions",
        data=json.dumps({"model": model, "prompt": "Reverse the digits: 123", "max_tokens": 4}).encode(),
        headers={"Authorization": f"Bearer {stack.state.gateway_token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        completion = json.loads(reply.read())
    assert completion["model"] == model, completion
    return completion


def test_every_dashboard_query_has_a_series_from_a_live_run(tmp_path, monkeypatch) -> None:
    # Spans recorded (to a span log), so latency observations carry trace-id exemplars.
    span_log = tmp_path / "spans.jsonl"
    monkeypatch.setenv("LOOPRL_SPAN_LOG", str(span_log))
    promtool, promtool_missing = prometheus.find_or_install("promtool")
    server, server_missing = prometheus.find_or_install("prometheus")
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": STEPS})
    queries = [runnable(q) for q in promql(load())]
    results: dict[str, list] = {}
    exemplars: list[dict] = []
    (tmp_path / "stack").mkdir()
    # The recipe's deployments are the stack's: they still serve the run's policy after it ends.
    with local_stack(tmp_path / "stack", DEFAULT_RECIPE) as stack:
        ports = {svc.name: svc.metrics_port for svc in stack.state.services}
        router_metrics = ports["inference-router"]
        if server is not None:
            targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
            started = time.time()
            # Replicas bind a port the kernel picks: Prometheus finds them through the router.
            discovered = {"inference-replica": f"http://127.0.0.1:{router_metrics}/targets"}
            with prometheus.running(server, targets, tmp_path / "prometheus", discovered=discovered) as prom:
                run_started = time.monotonic()
                run = run_to_end(stack.stub, stack.metadata, recipe, "e2e-metrics", timeout=300)
                usage = openai_completion(stack, "e2e-metrics")["usage"]
                checks_started = time.monotonic()
                time.sleep(3)  # two more scrapes after the last step and the request
                results = {q: prom.query(q) for q in queries}
                replicas_up = prom.query('up{job="inference-replica"}')
                exemplars = prom.exemplars('{__name__=~"looprl_.+_bucket"}', started, time.time())
            print(
                f"run {checks_started - run_started:.1f}s; {len(queries)} dashboard queries evaluated "
                f"{time.monotonic() - checks_started:.1f}s after it"
            )
        else:
            run = run_to_end(stack.stub, stack.metadata, recipe, "e2e-metrics", timeout=300)
            usage = openai_completion(stack, "e2e-metrics")["usage"]
        expositions = {name: scrape(port) for name, port in ports.items()}
        replicas = replica_targets(router_metrics)
        expositions |= {f"replica {t['labels']['replica']}": scrape(t["targets"][0]) for t in replicas}
    traced = {json.loads(line)["trace_id"] for line in span_log.read_text().splitlines() if line}
    found: dict[str, list] = {}
    for exposition in expositions.values():
        for name, series in samples(exposition).items():
            found.setdefault(name, []).extend(series)

    # Every metric a panel reads is exported, with at least one series.
    wanted = {
        n for q in promql(load()) for n in metric_names(q) if not n.startswith(EXTERNAL_METRIC_PREFIXES)
    }
    missing = sorted(n for n in wanted if not found.get(n))
    assert not missing, f"dashboard metrics with no series in any scrape: {missing}"
    # And every exported looprl series is in the one table.
    strays = sorted(n for n in found if n.startswith("looprl_") and not in_table(n))
    assert not strays, f"exported but not in services/kit/telemetry/metrics.py: {strays}"

    # The values say what happened in the run.
    run_id = run.run_id
    assert total(found, "looprl_trainer_steps_total", run=run_id) == STEPS
    assert total(found, "looprl_trainer_tokens_total", run=run_id) > 0
    assert total(found, "looprl_trainer_step_seconds_count", run=run_id, phase="train") == STEPS
    assert total(found, "looprl_trainer_checkpoint_seconds_count", run=run_id, kind="checkpoint") >= 1
    versions = {s.labels["deployment"]: s.value for s in found["looprl_weight_sync_deployment_version"]}
    assert versions and all(v == STEPS for v in versions.values()), versions
    assert total(found, "looprl_weight_sync_pushed_bytes_total", run=run_id) > 0
    rollouts = STEPS * 64
    assert total(found, "looprl_reward_score_count") >= rollouts
    assert total(found, "looprl_packer_acked_rollouts_total", run=run_id) == rollouts
    assert total(found, "looprl_gateway_runs", state="completed") == 1
    assert total(found, "looprl_gateway_run_step", run=run_id) == STEPS
    assert total(found, "looprl_gateway_openai_requests_total", endpoint="completions", status="200") == 1
    assert (
        total(found, "looprl_gateway_openai_tokens_total", endpoint="completions", kind="completion")
        == (usage["completion_tokens"])
    )
    # A forked group is one Generate for all its samples: at least one per step, plus the OpenAI one.
    assert total(found, "looprl_router_requests_total", outcome="ok") >= STEPS + 1
    # Each replica exports its own series on the port the router lists for it.
    assert [t["labels"]["deployment"] for t in replicas] == ["short"], replicas
    replica = replicas[0]["labels"]["replica"]
    assert total(found, "looprl_replica_ready", replica=replica) == 1
    # Weight-sync delivered every version to it over its gRPC port: counted by the replica itself.
    assert total(found, "looprl_rpc_requests_total", service=f"replica/{replica}") >= STEPS
    # Zeroed series exist before anything happens to them.
    assert found.get("looprl_router_retries_total") and found.get("looprl_packer_dropped_rollouts_total")

    if promtool is None:
        warnings.warn(f"promtool check metrics skipped: {promtool_missing}", stacklevel=1)
        print(f"SKIPPED promtool check metrics: {promtool_missing}")
    else:
        problems = {name: prometheus.check_metrics(promtool, text) for name, text in expositions.items()}
        assert not any(problems.values()), f"promtool check metrics: {problems}"
    if server is None:
        warnings.warn(f"dashboard queries not evaluated: {server_missing}", stacklevel=1)
        print(f"SKIPPED evaluating dashboard queries in Prometheus: {server_missing}")
    else:
        empty = [q for q, series in results.items() if not series]
        assert not empty, f"dashboard queries with no series: {empty}"
        assert [s["value"][1] for s in replicas_up] == ["1"], f"replicas scraped: {replicas_up}"
        # Latency histograms carry trace ids, of traces the services really recorded.
        by_metric = {
            e["seriesLabels"]["__name__"]: {x["labels"].get("trace_id") for x in e["exemplars"]}
            for e in exemplars
        }
        for metric in ("looprl_rpc_duration_seconds_bucket", "looprl_trainer_step_seconds_bucket"):
            assert by_metric.get(metric), f"no exemplar on {metric}; exemplars on {sorted(by_metric)}"
            assert by_metric[metric] & traced, f"{metric}: exemplar trace ids are not in the span log"
