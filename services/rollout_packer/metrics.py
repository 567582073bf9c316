"""Prometheus metrics of the packer (process-wide registry, labelled by run; names:
services/kit/telemetry/metrics.py). `init_run` creates a run's drop counters at zero, one per reason."""

from __future__ import annotations

from services.kit.telemetry.metrics import counter, gauge, histogram
from services.rollout_packer.sequences import DropReason

PADDING_FRACTION = gauge("looprl_packer_padding_fraction")
RANK_IMBALANCE = gauge("looprl_packer_rank_imbalance")
SYNC_IDLE = gauge("looprl_packer_sync_idle_fraction")
DROPPED = counter("looprl_packer_dropped_rollouts_total")
DROPPED_GROUPS = counter("looprl_packer_dropped_groups_total")
# Reasons a group is dropped whole (and replaced by the gateway).
GROUP_DROP_REASONS = (
    DropReason.ZERO_VARIANCE_GROUP,
    DropReason.STALE,
    DropReason.GROUP_TOO_SMALL,
    DropReason.STRAGGLER_TIMEOUT,
)
QUEUE_DEPTH = gauge("looprl_packer_queued_rollouts")
PENDING_GROUPS = gauge("looprl_packer_pending_groups")
STEPS_PLANNED = counter("looprl_packer_steps_planned_total")
ACKED = counter("looprl_packer_acked_rollouts_total")
PLAN_SECONDS = histogram("looprl_packer_plan_seconds")
STALENESS = gauge("looprl_packer_staleness_steps")
UNACKED_STEPS = gauge("looprl_packer_unacked_steps")


def init_run(run_id: str) -> None:
    """Every series of a run, at zero (the gauges until its first step sets them)."""
    for reason in DropReason:
        DROPPED.labels(run_id, reason.value)
    for reason in GROUP_DROP_REASONS:
        DROPPED_GROUPS.labels(run_id, reason.value)
    for metric in (
        PADDING_FRACTION,
        RANK_IMBALANCE,
        SYNC_IDLE,
        QUEUE_DEPTH,
        PENDING_GROUPS,
        STALENESS,
        UNACKED_STEPS,
        STEPS_PLANNED,
        ACKED,
        PLAN_SECONDS,
    ):
        metric.labels(run_id)
