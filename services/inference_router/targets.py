"""The router's /targets: every replica's /metrics address as Prometheus HTTP service discovery.

Replicas come and go with runs and bind a metrics port the kernel picks (replica_server.py), so no
static scrape config can list them. Prometheus asks the router instead (`http_sd_configs` with
`url: http://<router>:<metrics port>/targets`, observability/prometheus/prometheus.yml): one target
group per replica, labelled with its deployment, replica and the run whose policy it serves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from services.inference_router.router import Router

PATH = "/targets"


def replica_targets(router: Router) -> list[dict]:
    """Prometheus HTTP SD target groups, one per replica that reported a metrics address."""
    return [
        {
            "targets": [r.metrics_address],
            "labels": {"deployment": d.name, "replica": r.name, "run": d.run_id},
        }
        for d in router.deployment_list()
        for r in d.replicas
        if r.metrics_address
    ]


def targets_route(router: Router, loop: asyncio.AbstractEventLoop) -> Callable[[], bytes]:
    """The /targets body, built on the router's event loop (the metrics server answers from its own
    thread, while the loop changes the deployments)."""

    async def snapshot() -> list[dict]:
        return replica_targets(router)

    def body() -> bytes:
        return json.dumps(asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=5)).encode()

    return body
