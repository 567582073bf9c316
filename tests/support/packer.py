"""A rollout-packer service in the test's own process, on a given nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from looprl.packer.v1 import packer_pb2_grpc
from services.kit.local.infra import free_port
from services.kit.rpc.server import Service
from services.rollout_packer.config import PackerConfig
from services.rollout_packer.runs import PackerApp
from services.rollout_packer.servicer import RolloutPackerServicer


@asynccontextmanager
async def running_packer(nats_url: str, **settings: Any) -> AsyncIterator[tuple[PackerApp, Service]]:
    """A serving packer that packs only the runs it is told about (watch_runs off unless given)."""
    cfg = PackerConfig(
        nats_url=nats_url,
        grpc_port=free_port(),
        metrics_port=free_port(),
        **{"watch_runs": False, "grace_seconds": 2.0, **settings},
    )
    app = PackerApp(cfg)
    service = Service("rollout-packer", cfg)
    service.add(packer_pb2_grpc.add_RolloutPackerServiceServicer_to_server, RolloutPackerServicer(app.lookup))
    service.on_shutdown(app.stop)
    await service.start()
    await app.start()
    await service.mark_ready()
    try:
        yield app, service
    finally:
        await service.drain()
