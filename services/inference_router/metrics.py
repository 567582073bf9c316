"""Prometheus metrics of the router, per deployment and per replica (names: services/kit/telemetry/metrics.py).

Defined once per process (the registry is global); every Router instance in the process shares them.
`init_deployment` creates every labelled series of a deployment at zero when it is added, so a
dashboard shows 0 retries rather than "No data".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from services.decisions.pd_ratio import REASONS as SPLIT_REASONS
from services.inference_router import policies
from services.kit.telemetry.metrics import counter, gauge, histogram

REQUESTS = counter("looprl_router_requests_total")
TOKENS = counter("looprl_router_tokens_total")  # kind: prompt | completion
LATENCY = histogram("looprl_router_request_seconds")
OUTSTANDING_REQUESTS = gauge("looprl_router_outstanding_requests")
OUTSTANDING_TOKENS = gauge("looprl_router_outstanding_tokens")
DECISIONS = counter("looprl_router_decisions_total")
DECISION_SECONDS = histogram("looprl_router_decision_seconds")
RETRIES = counter("looprl_router_retries_total")
REJECTIONS = counter("looprl_router_rejections_total")
REPLICA_VERSION = gauge("looprl_router_replica_weight_version")
REPLICA_ROUTABLE = gauge("looprl_router_replica_routable")
LENGTH_ERROR = histogram("looprl_router_length_prediction_error_tokens")
LENGTH_PREDICTIONS = counter("looprl_router_length_predictions_total")
KV_HANDOFFS = counter("looprl_router_kv_handoffs_total")  # transfer: shm | grpc | nixl | recompute
PREFILL_SECONDS = histogram("looprl_router_prefill_seconds")
SPLIT_WORKERS = gauge("looprl_router_split_workers")  # role: prefill | decode
SPLIT_DECISIONS = counter("looprl_router_split_decisions_total")
SPLIT_STAGE_SPEED = gauge("looprl_router_split_stage_tokens_per_second")  # stage: prefill | decode

OUTCOMES = ("ok", "failed", "rejected")
TOKEN_KINDS = ("prompt", "completion")
REJECTION_REASONS = ("unavailable", "invalid", "backpressure", "version", "attempts")
PREDICTION_OUTCOMES = ("in_profile", "outside_profile", "unpredicted")
DECISION_REASONS = tuple(
    getattr(policies, name) for name in sorted(dir(policies)) if name.startswith("REASON_")
)

for _reason in REJECTION_REASONS:
    REJECTIONS.labels(_reason)


def init_deployment(deployment: str, replicas: Sequence[str]) -> None:
    """Every series of a deployment and its replicas, at zero."""
    LATENCY.labels(deployment)
    LENGTH_ERROR.labels(deployment)
    for outcome in PREDICTION_OUTCOMES:
        LENGTH_PREDICTIONS.labels(deployment, outcome)
    for reason in DECISION_REASONS:
        DECISIONS.labels(deployment, reason)
    for replica in replicas:
        for outcome in OUTCOMES:
            REQUESTS.labels(deployment, replica, outcome)
        for kind in TOKEN_KINDS:
            TOKENS.labels(deployment, replica, kind)
        RETRIES.labels(deployment, replica)
        OUTSTANDING_REQUESTS.labels(deployment, replica)
        OUTSTANDING_TOKENS.labels(deployment, replica)


def init_disaggregated(deployment: str) -> None:
    """The series of a disaggregated deployment's handoffs and split, at zero."""
    PREFILL_SECONDS.labels(deployment)
    for transfer in ("shm", "grpc", "nixl", "recompute"):
        KV_HANDOFFS.labels(deployment, transfer)
    for role in ("prefill", "decode"):
        SPLIT_WORKERS.labels(deployment, role)
        SPLIT_STAGE_SPEED.labels(deployment, role)
    for reason in SPLIT_REASONS:
        SPLIT_DECISIONS.labels(deployment, reason)


def drop_deployment(deployment: str, replicas: Sequence[str]) -> None:
    """Forget the gauges of a removed deployment's replicas (a run ended): a replica that no longer
    exists must not keep showing as routable with its last version. Counters keep their totals."""
    for gauge_ in (OUTSTANDING_REQUESTS, OUTSTANDING_TOKENS, REPLICA_VERSION, REPLICA_ROUTABLE):
        for replica in replicas:
            with contextlib.suppress(KeyError):
                gauge_.remove(deployment, replica)
    for gauge_ in (SPLIT_WORKERS, SPLIT_STAGE_SPEED):
        for role in ("prefill", "decode"):
            with contextlib.suppress(KeyError):
                gauge_.remove(deployment, role)
