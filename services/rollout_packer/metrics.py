"""Prometheus metrics of the packer (process-wide registry, labelled by run)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PADDING_FRACTION = Gauge(
    "looprl_packer_padding_fraction", "Unused share of the micro-batch token budget, last step", ["run"]
)
RANK_IMBALANCE = Gauge("looprl_packer_rank_imbalance", "max/mean work per DP rank, last step", ["run"])
SYNC_IDLE = Gauge(
    "looprl_packer_sync_idle_fraction", "Rank time spent waiting at micro-batch syncs, last step", ["run"]
)
DROPPED = Counter("looprl_packer_dropped_rollouts_total", "Rollouts dropped, by reason", ["run", "reason"])
QUEUE_DEPTH = Gauge("looprl_packer_queued_rollouts", "Rollouts held and not yet planned into a step", ["run"])
PENDING_GROUPS = Gauge("looprl_packer_pending_groups", "Groups incomplete or complete but unplanned", ["run"])
STEPS_PLANNED = Counter("looprl_packer_steps_planned_total", "Steps planned", ["run"])
ACKED = Counter("looprl_packer_acked_rollouts_total", "Rollouts acked after their step was trained", ["run"])
PLAN_SECONDS = Histogram(
    "looprl_packer_plan_seconds",
    "Time to compute advantages and the pack plan of a step",
    ["run"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
