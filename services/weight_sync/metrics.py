"""Prometheus metrics of weight-sync (names: services/kit/metric_names.py): versions pushed and
served per deployment, delivery time and bytes by transport, rejected and failed deliveries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.kit.metric_names import counter, gauge, histogram, observe
from services.kit.weight_transfer import Endpoint, StageResult

LATEST_VERSION = gauge("looprl_weightsync_latest_version")
DEPLOYMENT_VERSION = gauge("looprl_weightsync_deployment_version")
PUSHED_BYTES = counter("looprl_weightsync_pushed_bytes_total")
SYNC_SECONDS = histogram("looprl_weightsync_sync_seconds")
SYNC_BYTES = counter("looprl_weightsync_sync_bytes_total")
REJECTED = counter("looprl_weightsync_rejected_versions_total")
FAILED = counter("looprl_weightsync_failed_syncs_total")


def transport_of(endpoint: Endpoint) -> str:
    """Receivers on this host read shared memory; the others are sent the bytes over gRPC."""
    return "shm" if endpoint.same_host else "grpc"


def transports(endpoints: Iterable[Endpoint]) -> str:
    used = {transport_of(e) for e in endpoints}
    return used.pop() if len(used) == 1 else "mixed"


def init_deployment(deployment: str, endpoints: Iterable[Endpoint]) -> None:
    """A registered deployment's series at zero."""
    endpoints = list(endpoints)
    REJECTED.labels(deployment)
    FAILED.labels(deployment)
    SYNC_SECONDS.labels(deployment, transports(endpoints))
    for transport in {transport_of(e) for e in endpoints}:
        SYNC_BYTES.labels(deployment, transport)


def delivered(
    run_id: str,
    deployment: str,
    version: int,
    seconds: float,
    endpoints: Iterable[Endpoint],
    results: Mapping[Endpoint, StageResult],
) -> None:
    """A version committed on every replica of a deployment."""
    endpoints = list(endpoints)
    DEPLOYMENT_VERSION.labels(run_id, deployment).set(version)
    observe(SYNC_SECONDS.labels(deployment, transports(endpoints)), seconds)
    for e in endpoints:
        if e in results:
            SYNC_BYTES.labels(deployment, transport_of(e)).inc(results[e].bytes_sent)
