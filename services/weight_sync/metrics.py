"""Prometheus metrics of weight-sync (names: services/kit/telemetry/metrics.py): versions pushed and
served per deployment, delivery time by transport, rejected and failed deliveries. Bytes by
transport and host are counted where routes are decided (placement.py)."""

from __future__ import annotations

from collections.abc import Iterable

from services.kit.telemetry.metrics import counter, gauge, histogram, observe

LATEST_VERSION = gauge("looprl_weight_sync_latest_version")
DEPLOYMENT_VERSION = gauge("looprl_weight_sync_deployment_version")
PUSHED_BYTES = counter("looprl_weight_sync_pushed_bytes_total")
VERSION_BYTES = gauge("looprl_weight_sync_version_bytes")
SYNC_SECONDS = histogram("looprl_weight_sync_sync_seconds")
REJECTED = counter("looprl_weight_sync_rejected_versions_total")
FAILED = counter("looprl_weight_sync_failed_syncs_total")


def transport(kinds: Iterable[str]) -> str:
    """How a deployment is reached: the transport kind of its ranks, or mixed when they differ."""
    used = set(kinds)
    return used.pop() if len(used) == 1 else "mixed"


# The labelled series of each deployment, dropped when it is unregistered: runs come and go, and
# their deployments' series must not pile up.
_series: dict[str, set[tuple[object, tuple[str, ...]]]] = {}


def _child(metric, deployment: str, *labels: str):
    _series.setdefault(deployment, set()).add((metric, labels))
    return metric.labels(*labels)


def init_deployment(deployment: str, reached_by: str) -> None:
    """A registered deployment's series at zero."""
    _child(REJECTED, deployment, deployment)
    _child(FAILED, deployment, deployment)
    _child(SYNC_SECONDS, deployment, deployment, reached_by)


def delivered(run_id: str, deployment: str, version: int, seconds: float, reached_by: str) -> None:
    """A version committed on every replica of a deployment."""
    _child(DEPLOYMENT_VERSION, deployment, run_id, deployment).set(version)
    observe(_child(SYNC_SECONDS, deployment, deployment, reached_by), seconds)


def failed(deployment: str) -> None:
    _child(FAILED, deployment, deployment).inc()


def rejected(deployment: str) -> None:
    _child(REJECTED, deployment, deployment).inc()


def forget_deployment(deployment: str) -> None:
    """An unregistered deployment: its series leave /metrics."""
    for metric, labels in _series.pop(deployment, ()):
        try:
            metric.remove(*labels)
        except KeyError:
            pass
