"""Prometheus metrics of the router, per deployment and per replica.

Defined once per process (the registry is global); every Router instance in the process shares them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "looprl_router_requests_total",
    "Generate requests finished, by where they ran and how they ended",
    ["deployment", "replica", "outcome"],
)
TOKENS = Counter(
    "looprl_router_tokens_total", "Tokens served", ["deployment", "replica", "kind"]
)  # kind: prompt | completion
LATENCY = Histogram(
    "looprl_router_request_seconds",
    "End-to-end generate time through the router",
    ["deployment"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
OUTSTANDING_REQUESTS = Gauge(
    "looprl_router_outstanding_requests", "Requests in flight", ["deployment", "replica"]
)
OUTSTANDING_TOKENS = Gauge(
    "looprl_router_outstanding_tokens", "Tokens reserved by requests in flight", ["deployment", "replica"]
)
DECISIONS = Counter("looprl_router_decisions_total", "Routing decisions by reason", ["deployment", "reason"])
DECISION_SECONDS = Histogram(
    "looprl_router_decision_seconds",
    "Time the routing policy takes to decide",
    buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3),
)
RETRIES = Counter(
    "looprl_router_retries_total",
    "Attempts that failed on a replica and were retried",
    ["deployment", "replica"],
)
REJECTIONS = Counter("looprl_router_rejections_total", "Requests refused", ["reason"])
REPLICA_VERSION = Gauge(
    "looprl_router_replica_weight_version", "Weight version a replica serves", ["deployment", "replica"]
)
REPLICA_ROUTABLE = Gauge(
    "looprl_router_replica_routable", "1 when the replica takes traffic", ["deployment", "replica"]
)
