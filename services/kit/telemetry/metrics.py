"""Every Prometheus metric looprl exports, in one table: name, type, unit, labels, help, owner.

Services create their metrics from this table (`counter`, `gauge`, `histogram`), so a name, its
labels and its help text exist once; docs/metrics.md is rendered from it (`python -m
services.kit.telemetry.metrics > docs/metrics.md`) and the dashboard may query only names it lists
(tests/unit/deploy). Names follow Prometheus conventions: base units in the name (`_seconds`,
`_bytes`), counters end in `_total`. `observe` attaches the current trace id as an exemplar, which
the OpenMetrics exposition (what Prometheus asks /metrics for) carries to Grafana's trace links.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LONG_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The first bound is 0, not negative: prometheus-client leaves out a histogram's _sum when a bucket
# bound is below 0 (and the mean score is sum / count). A negative score falls in the le="0" bucket.
SCORE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed; a counter's ends in _total
    kind: str  # counter | gauge | histogram
    unit: str
    labels: tuple[str, ...]
    help: str
    service: str  # the service that exports it ("every" for the kit's own)
    buckets: tuple[float, ...] = ()

    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric (without the _created companions)."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _c(name: str, unit: str, labels: Sequence[str], help: str, service: str) -> MetricSpec:
    return MetricSpec(name, "counter", unit, tuple(labels), help, service)


def _g(name: str, unit: str, labels: Sequence[str], help: str, service: str) -> MetricSpec:
    return MetricSpec(name, "gauge", unit, tuple(labels), help, service)


def _h(
    name: str, unit: str, labels: Sequence[str], help: str, service: str, buckets: tuple[float, ...]
) -> MetricSpec:
    return MetricSpec(name, "histogram", unit, tuple(labels), help, service, buckets)


RUN = ("run",)

CATALOG: tuple[MetricSpec, ...] = (
    # ---- every service (services/kit/rpc/interceptors.py)
    _c("looprl_rpc_requests_total", "requests", ("service", "method", "code"), "RPCs handled", "every"),
    _h(
        "looprl_rpc_duration_seconds",
        "seconds",
        ("service", "method"),
        "RPC handling time",
        "every",
        SECONDS_BUCKETS,
    ),
    _g("looprl_rpc_in_flight", "requests", ("service",), "RPCs being handled", "every"),
    # ---- gateway
    _g("looprl_gateway_runs", "runs", ("state",), "Runs in the stack's run store, by state", "gateway"),
    _g("looprl_gateway_run_step", "steps", RUN, "Steps the run has trained (from its record)", "gateway"),
    _g(
        "looprl_gateway_run_weight_version",
        "version",
        RUN,
        "Newest weight version trained by the run",
        "gateway",
    ),
    _g(
        "looprl_gateway_run_eval_pass_at_1",
        "ratio",
        RUN,
        "pass@1 on the run's held-out split at its latest evaluation (eval.every)",
        "gateway",
    ),
    _g(
        "looprl_gateway_run_eval_mean_reward",
        "reward",
        RUN,
        "Mean reward on the run's held-out split at its latest evaluation",
        "gateway",
    ),
    _c(
        "looprl_gateway_resampled_groups_total",
        "groups",
        RUN,
        "Groups fed to replace groups the packer dropped, so that every step trains a full batch",
        "gateway",
    ),
    _c(
        "looprl_gateway_http_requests_total",
        "requests",
        ("route", "method", "status"),
        "HTTP API requests answered, by route pattern and HTTP status",
        "gateway",
    ),
    _h(
        "looprl_gateway_http_request_seconds",
        "seconds",
        ("route", "status"),
        "HTTP API request time, by route pattern and HTTP status",
        "gateway",
        LONG_SECONDS_BUCKETS,
    ),
    _c(
        "looprl_gateway_openai_requests_total",
        "requests",
        ("endpoint", "status"),
        "OpenAI-compatible requests, by endpoint and HTTP status",
        "gateway",
    ),
    _c(
        "looprl_gateway_openai_tokens_total",
        "tokens",
        ("endpoint", "kind"),
        "Tokens of answered OpenAI-compatible requests (kind: prompt | completion)",
        "gateway",
    ),
    # ---- trainer (rank 0's all-reduced values of the last step)
    _g("looprl_trainer_loss", "1", RUN, "Policy loss of the last step", "trainer"),
    _g("looprl_trainer_kl", "nats", RUN, "KL to the reference policy, last step", "trainer"),
    _g("looprl_trainer_entropy", "nats", RUN, "Mean token entropy of the policy, last step", "trainer"),
    _g("looprl_trainer_grad_norm", "1", RUN, "Gradient norm before clipping, last step", "trainer"),
    _g(
        "looprl_trainer_clip_fraction",
        "ratio",
        RUN,
        "Share of tokens whose ratio was clipped, last step",
        "trainer",
    ),
    _g(
        "looprl_trainer_reward_mean", "reward", RUN, "Mean reward of the rollouts of the last step", "trainer"
    ),
    _g(
        "looprl_trainer_importance_ratio",
        "ratio",
        ("run", "stat"),
        "exp(trainer log-prob - sampler log-prob) over the last step's trained tokens, before its update "
        "(stat: mean | max | min | clipped, the share outside the PPO clip range)",
        "trainer",
    ),
    _g(
        "looprl_trainer_staleness_steps",
        "steps",
        ("run", "stat"),
        "Policy lag of the last step's rollouts (stat: mean | max)",
        "trainer",
    ),
    _g(
        "looprl_trainer_tokens_per_second", "tokens/s", RUN, "Trained tokens per second, last step", "trainer"
    ),
    _g(
        "looprl_trainer_weight_version", "version", RUN, "Weight version the trainer produced last", "trainer"
    ),
    _c("looprl_trainer_steps_total", "steps", RUN, "Steps trained", "trainer"),
    _c("looprl_trainer_tokens_total", "tokens", RUN, "Tokens trained", "trainer"),
    _h(
        "looprl_trainer_step_seconds",
        "seconds",
        ("run", "phase"),
        "Step time by phase (pull: NextBatch, train: forward/backward/optimizer, push: shards to "
        "weight-sync, step: the whole step as the loop sees it)",
        "trainer",
        LONG_SECONDS_BUCKETS,
    ),
    _h(
        "looprl_trainer_checkpoint_seconds",
        "seconds",
        ("run", "kind"),
        "Checkpoint time (kind: checkpoint | hf_export)",
        "trainer",
        LONG_SECONDS_BUCKETS,
    ),
    # ---- weight-sync
    _g(
        "looprl_weight_sync_latest_version",
        "version",
        RUN,
        "Newest version every trainer rank pushed",
        "weight-sync",
    ),
    _g(
        "looprl_weight_sync_deployment_version",
        "version",
        ("run", "deployment"),
        "Version each deployment serves (committed on every replica)",
        "weight-sync",
    ),
    _c(
        "looprl_weight_sync_pushed_bytes_total", "bytes", RUN, "Bytes the trainer ranks pushed", "weight-sync"
    ),
    _g(
        "looprl_weight_sync_version_bytes",
        "bytes",
        RUN,
        "Bytes of the run's newest complete version as the trainer pushed it (a LoRA run's: its adapter's tensors)",
        "weight-sync",
    ),
    _h(
        "looprl_weight_sync_sync_seconds",
        "seconds",
        ("deployment", "transport"),
        "Time to deliver one version to a deployment (transport: the weight_transport kind that reached its "
        "ranks - shm, grpc, shared_copy, cuda_ipc, nccl - or mixed)",
        "weight-sync",
        LONG_SECONDS_BUCKETS,
    ),
    _c(
        "looprl_weight_sync_delivered_bytes_total",
        "bytes",
        ("transport", "host"),
        "Weight payload bytes delivered, by transport (shm, grpc, shared_copy, cuda_ipc or nccl) and "
        "receiver host identity",
        "weight-sync",
    ),
    _c(
        "looprl_weight_sync_rejected_versions_total",
        "versions",
        ("deployment",),
        "Versions a deployment's canary rejected",
        "weight-sync",
    ),
    _c(
        "looprl_weight_sync_failed_syncs_total",
        "deliveries",
        ("deployment",),
        "Deliveries to a deployment that failed (retried)",
        "weight-sync",
    ),
    # ---- reward
    _h("looprl_reward_score", "reward", ("reward",), "Scores given, by reward", "reward", SCORE_BUCKETS),
    _h(
        "looprl_reward_seconds",
        "seconds",
        ("reward",),
        "Time to score one completion, by reward",
        "reward",
        SECONDS_BUCKETS,
    ),
    _c(
        "looprl_reward_failures_total",
        "components",
        ("reward", "reason"),
        "Reward components that failed (reason: timeout | rejected | crashed)",
        "reward",
    ),
    # ---- inference-router
    _c(
        "looprl_router_requests_total",
        "requests",
        ("deployment", "replica", "outcome"),
        "Generate requests finished, by where they ran and how they ended (ok | failed | rejected)",
        "inference-router",
    ),
    _c(
        "looprl_router_tokens_total",
        "tokens",
        ("deployment", "replica", "kind"),
        "Tokens served (kind: prompt | completion)",
        "inference-router",
    ),
    _h(
        "looprl_router_request_seconds",
        "seconds",
        ("deployment",),
        "End-to-end generate time through the router",
        "inference-router",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    ),
    _g(
        "looprl_router_outstanding_requests",
        "requests",
        ("deployment", "replica"),
        "Requests in flight",
        "inference-router",
    ),
    _g(
        "looprl_router_outstanding_tokens",
        "tokens",
        ("deployment", "replica"),
        "Tokens reserved by requests in flight",
        "inference-router",
    ),
    _c(
        "looprl_router_decisions_total",
        "decisions",
        ("deployment", "reason"),
        "Routing decisions by reason",
        "inference-router",
    ),
    _h(
        "looprl_router_decision_seconds",
        "seconds",
        (),
        "Time the routing policy takes to decide",
        "inference-router",
        (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3),
    ),
    _c(
        "looprl_router_retries_total",
        "attempts",
        ("deployment", "replica"),
        "Attempts that failed on a replica and were retried",
        "inference-router",
    ),
    _c("looprl_router_rejections_total", "requests", ("reason",), "Requests refused", "inference-router"),
    _h(
        "looprl_router_length_prediction_error_tokens",
        "tokens",
        ("deployment",),
        "|actual - predicted| output tokens of each completion whose request carried a predicted length "
        "(GenerateRequest.expected_output_tokens)",
        "inference-router",
        (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    ),
    _c(
        "looprl_router_length_predictions_total",
        "completions",
        ("deployment", "outcome"),
        "Completions by whether their actual length fell inside the output-length profile of the "
        "deployment that served them (in_profile | outside_profile), or came without a predicted "
        "length (unpredicted)",
        "inference-router",
    ),
    _g(
        "looprl_router_replica_weight_version",
        "version",
        ("deployment", "replica"),
        "Weight version a replica serves",
        "inference-router",
    ),
    _g(
        "looprl_router_replica_routable",
        "bool",
        ("deployment", "replica"),
        "1 when the replica takes traffic",
        "inference-router",
    ),
    _c(
        "looprl_router_kv_handoffs_total",
        "requests",
        ("deployment", "transfer"),
        "Decodes on disaggregated deployments by how the decode worker got the prompt's KV (shm | grpc | "
        "nixl: vLLM's connector | recompute: it computed the prompt itself)",
        "inference-router",
    ),
    _h(
        "looprl_router_prefill_seconds",
        "seconds",
        ("deployment",),
        "Prefill phase of a request to a disaggregated deployment (the prefill worker's round trip)",
        "inference-router",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    ),
    _g(
        "looprl_router_split_workers",
        "workers",
        ("deployment", "role"),
        "Workers of a disaggregated deployment that prefill or decode (role), as tuned",
        "inference-router",
    ),
    _c(
        "looprl_router_split_decisions_total",
        "decisions",
        ("deployment", "reason"),
        "Prefill:decode split decisions at weight-version boundaries, by reason (services/decisions/pd_ratio.py)",
        "inference-router",
    ),
    _g(
        "looprl_router_split_stage_tokens_per_second",
        "tokens/s",
        ("deployment", "stage"),
        "Per-worker speed of each stage (prefill: prompt tokens/s; decode: output tokens/s at the "
        "measured batch) the last split decision used",
        "inference-router",
    ),
    # ---- each inference replica (its own /metrics: ReplicaInfo.metrics_address, found through the
    # router's /targets; its RPCs are looprl_rpc_* with service "replica/<name>")
    _g(
        "looprl_replica_ready",
        "bool",
        ("deployment", "replica"),
        "1 when it holds weights and serves",
        "inference-replica",
    ),
    _g(
        "looprl_replica_queued_requests",
        "requests",
        ("deployment", "replica"),
        "Requests waiting in the engine for a batch slot",
        "inference-replica",
    ),
    _g(
        "looprl_replica_tokens_in_flight",
        "tokens",
        ("deployment", "replica"),
        "Prompt and completion tokens of the sequences in the engine",
        "inference-replica",
    ),
    _g(
        "looprl_replica_cache_usage",
        "ratio",
        ("deployment", "replica"),
        "Share of the KV cache in use",
        "inference-replica",
    ),
    # ---- rollout-packer
    _g(
        "looprl_packer_padding_fraction",
        "ratio",
        RUN,
        "Unused share of the micro-batch token budget, last step",
        "rollout-packer",
    ),
    _g(
        "looprl_packer_rank_imbalance", "ratio", RUN, "max/mean work per DP rank, last step", "rollout-packer"
    ),
    _g(
        "looprl_packer_sync_idle_fraction",
        "ratio",
        RUN,
        "Rank time spent waiting at micro-batch syncs, last step",
        "rollout-packer",
    ),
    _c(
        "looprl_packer_dropped_rollouts_total",
        "rollouts",
        ("run", "reason"),
        "Rollouts dropped, by reason",
        "rollout-packer",
    ),
    _c(
        "looprl_packer_dropped_groups_total",
        "groups",
        ("run", "reason"),
        "Groups dropped whole while a step filled (the gateway replaces each), by reason",
        "rollout-packer",
    ),
    _g(
        "looprl_packer_queued_rollouts",
        "rollouts",
        RUN,
        "Rollouts held and not yet planned into a step",
        "rollout-packer",
    ),
    _g(
        "looprl_packer_pending_groups",
        "groups",
        RUN,
        "Groups incomplete or complete but unplanned",
        "rollout-packer",
    ),
    _c("looprl_packer_steps_planned_total", "steps", RUN, "Steps planned", "rollout-packer"),
    _c(
        "looprl_packer_acked_rollouts_total",
        "rollouts",
        RUN,
        "Rollouts acked after their step was trained",
        "rollout-packer",
    ),
    _h(
        "looprl_packer_plan_seconds",
        "seconds",
        RUN,
        "Time to compute advantages and the pack plan of a step",
        "rollout-packer",
        (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    ),
    _g(
        "looprl_packer_staleness_steps",
        "steps",
        RUN,
        "Policy lag of the last built step: its trainer version minus its oldest rollout's",
        "rollout-packer",
    ),
    _g(
        "looprl_packer_unacked_steps",
        "steps",
        RUN,
        "Steps planned and not yet acknowledged by the trainer",
        "rollout-packer",
    ),
    # ---- environment-sandbox
    _g(
        "looprl_sandbox_fleet_actors",
        "actors",
        (),
        "Sandbox actors the fleet holds now",
        "environment-sandbox",
    ),
    _g(
        "looprl_sandbox_fleet_peak_actors",
        "actors",
        (),
        "Most sandbox actors the fleet held at once",
        "environment-sandbox",
    ),
    _c(
        "looprl_sandbox_fleet_executions_total",
        "executions",
        (),
        "Executions that ran on a sandbox actor",
        "environment-sandbox",
    ),
    _h(
        "looprl_workspace_setup_seconds",
        "seconds",
        ("start",),
        "Time from an episode asking for a repository workspace until commands can run in it "
        "(start: warm from the repository's pool, or cold)",
        "environment-sandbox",
        SECONDS_BUCKETS,
    ),
    _h(
        "looprl_workspace_fork_seconds",
        "seconds",
        (),
        "Time to fork a live workspace (freeze its upper layer, mount a new one over it)",
        "environment-sandbox",
        SECONDS_BUCKETS,
    ),
    _g(
        "looprl_workspaces",
        "workspaces",
        (),
        "Live repository workspaces (episodes and forks)",
        "environment-sandbox",
    ),
    _c(
        "looprl_repo_tool_calls_total",
        "calls",
        ("result",),
        "Tool calls in repo-environment replies (result: ok, malformed, unknown_tool, bad_arguments, "
        "no_call for a reply that called nothing)",
        "environment-sandbox",
    ),
    _c(
        "looprl_workspace_commands_total",
        "commands",
        ("result",),
        "Commands run in repository workspaces (result: exit_0, exit_nonzero, timeout, refused)",
        "environment-sandbox",
    ),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}
SERIES: dict[str, MetricSpec] = {s: m for m in CATALOG for s in m.series()}


def _spec(name: str, kind: str) -> MetricSpec:
    spec = BY_NAME.get(name)
    if spec is None:
        raise KeyError(f"metric {name!r} is not in services/kit/telemetry/metrics.py CATALOG")
    if spec.kind != kind:
        raise TypeError(f"metric {name!r} is a {spec.kind} in the catalog, not a {kind}")
    return spec


def counter(name: str) -> Counter:
    spec = _spec(name, "counter")
    return Counter(spec.name.removesuffix("_total"), spec.help, spec.labels)


def gauge(name: str) -> Gauge:
    spec = _spec(name, "gauge")
    return Gauge(spec.name, spec.help, spec.labels)


def histogram(name: str) -> Histogram:
    spec = _spec(name, "histogram")
    return Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets)


def observe(histogram_child: Histogram, value: float) -> None:
    """Observe a value, with the current (sampled) trace as its exemplar when there is one."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid and ctx.trace_flags.sampled:
        histogram_child.observe(value, exemplar={"trace_id": format(ctx.trace_id, "032x")})
    else:
        histogram_child.observe(value)


def render_markdown() -> str:
    """docs/metrics.md: the table, grouped by the service that exports it."""
    lines = [
        "# Metrics",
        "",
        "Every Prometheus metric looprl exports, rendered from `services/kit/telemetry/metrics.py` (the one",
        "place they are defined): `.venv/bin/python -m services.kit.telemetry.metrics > docs/metrics.md`.",
        "Each service serves them on its metrics port (`/metrics`, OpenMetrics when asked, so latency",
        "histograms carry trace-id exemplars). Labelled series are created at zero where the label",
        'values are known up front, so dashboards show 0 rather than "No data".',
        "",
    ]
    services = list(dict.fromkeys(m.service for m in CATALOG))
    for service in services:
        lines += [f"## {service}", "", "| metric | type | unit | labels | meaning |", "|---|---|---|---|---|"]
        for m in CATALOG:
            if m.service == service:
                labels = ", ".join(m.labels) or "-"
                lines.append(f"| `{m.name}` | {m.kind} | {m.unit} | {labels} | {m.help} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
