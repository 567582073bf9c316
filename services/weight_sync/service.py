"""The weight-sync wiring: the version store, the deliverer, the servicer, and the KV state and
events (state.py) attached at start.

State that survives a restart lives in the KV bucket "weights", each run under its own prefix: each
target's registration (`run.<run>.target.<deployment>`, re-registered at start), each deployment's
synced version (`run.<run>.deployment.<deployment>`) and each run's latest version's manifest
(`run.<run>.latest`, parameter names, shapes, dtypes, bytes, model config). The bytes of a version live only in memory: after a
restart the next pushed version is delivered (RequestSync says so until then). Shared-memory
segments a killed predecessor left behind are removed at start.
"""

from __future__ import annotations

import logging

from looprl.weightsync.v1 import weightsync_pb2_grpc
from services.kit.bus import subjects
from services.kit.config.service import bus_url
from services.kit.rpc.server import Service
from services.weight_sync.transport import sweep_stale_segments

from .config import WeightSyncConfig
from .deliver import Deliverer
from .servicer import WeightSyncServicer
from .state import StateStore
from .versions import VersionStore

log = logging.getLogger("looprl.weight_sync")


def make(cfg: WeightSyncConfig) -> WeightSyncServicer:
    """Store, deliverer and servicer; events and KV are attached by `attach_state`."""
    store = VersionStore(default_run=cfg.run_id)
    deliverer = Deliverer(
        store,
        bucket_bytes=cfg.bucket_bytes,
        shm_segments=cfg.shm_segments,
        prefetch=cfg.prefetch_buckets,
        shared_copy_min_receivers=cfg.shared_copy_min_receivers,
        shared_copies=cfg.shared_copies,
        retry_attempts=cfg.retry_attempts,
        retry_backoff_s=cfg.retry_backoff_s,
        stage_timeout_s=cfg.stage_timeout_s,
        pipeline=cfg.pipeline,
        canary_tokens=cfg.canary_tokens,
        canary_max_drift=cfg.canary_max_drift,
    )
    return WeightSyncServicer(store, deliverer)


async def attach_state(
    servicer: WeightSyncServicer, cfg: WeightSyncConfig, service: Service | None = None
) -> None:
    """Clean up after a dead predecessor, connect the bus, restore targets and the latest version."""
    removed = sweep_stale_segments()
    if removed:
        log.info("removed %d shared-memory segments left by a dead weight-sync", len(removed))
    if not cfg.use_bus:
        return
    from services.kit.bus.client import Bus

    bus = await Bus.connect(bus_url(cfg), name="weight-sync")
    await bus.ensure_streams()
    state = StateStore(bus, await bus.kv(subjects.WEIGHTS_KV), cfg.run_id)
    if service is not None:
        service.on_shutdown(bus.drain)
        service.on_shutdown(state.reporter.close)
    servicer.state = state
    servicer.deliverer.on_published = state.published
    servicer.deliverer.on_failed = state.failed
    servicer.deliverer.on_rejected = state.rejected
    await state.load(servicer.store, servicer.deliverer)


async def serve(cfg: WeightSyncConfig) -> None:
    service = Service("weight-sync", cfg)
    servicer = make(cfg)
    # PushShards gets its request bytes unparsed: protobuf would copy every chunk on parse and on
    # each access of its data (the copies were most of the time a push took to land)
    service.add(
        weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server, servicer, raw_requests=("PushShards",)
    )

    async def setup(svc: Service) -> None:
        svc.on_shutdown(servicer.deliverer.close)
        await attach_state(servicer, cfg, svc)
        latest = {r: v.latest_version for r, v in servicer.store.runs.items()}
        log.info("weight-sync ready on port %s (latest versions %s)", svc.grpc_port, latest)

    await service.run(setup)
