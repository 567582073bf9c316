"""WeightSyncService: trainer pushes in, target registrations, versions, sync requests.

Versions are numbered per run (PushShardsRequest.run_id; empty: the config's run_id): a run's
version goes only to the targets registered for that run, or with no run (any run's versions)."""

from __future__ import annotations

import asyncio
import json
import logging

from opentelemetry import trace

from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.kit.telemetry import tracing as telemetry
from services.modeling.config import ModelConfig
from services.weights.wire import decode_push_request

from . import metrics
from .deliver import Deliverer
from .plan import PlanError, check_trainer_layout, pushed_params
from .targets import target_from_request
from .versions import VersionBuffer, VersionStore

log = logging.getLogger("looprl.weight_sync")


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServiceServicer):
    def __init__(self, store: VersionStore, deliverer: Deliverer, state=None) -> None:
        self.store = store
        self.deliverer = deliverer
        self.state = state  # optional KV persistence (state.StateStore)
        self._completing = asyncio.Lock()

    async def PushShards(self, request_iterator, context):
        buf: VersionBuffer | None = None
        received = 0
        push = trace.get_current_span().get_span_context()
        try:
            async for req in request_iterator:
                if isinstance(req, bytes):  # registered with raw requests: chunks stay in place
                    req = decode_push_request(req)
                fresh = not self.store.is_pending(req.run_id, req.version)
                first = buf is None
                buf = self.store.buffer_for(req)
                if first and push.is_valid and len(buf.pushes) < telemetry.MAX_LINKS:
                    buf.pushes.append(push)  # the delivery of this version links to every rank's push
                if fresh:
                    config = self.deliverer.model_config(buf)
                    if config is not None:
                        buf.expected = pushed_params(config)
                    self.deliverer.version_started(buf)
                rank = req.trainer_rank
                received += await asyncio.to_thread(_add_all, buf, rank, req)
                await buf.notify()
                if req.last:
                    buf.ranks_done.add(rank)
                    if buf.complete:
                        await self._complete(buf)
        except Exception as exc:
            if buf is not None and not buf.complete:
                self.store.fail(buf.version, str(exc), buf.run_id)
                await buf.notify()
            raise
        if buf is None:
            raise InvalidArgument("PushShards: the stream carried no message")
        metrics.PUSHED_BYTES.labels(buf.run_id).inc(received)
        return weightsync_pb2.PushShardsResponse(
            version=buf.version, bytes_received=received, version_complete=buf.complete
        )

    async def _complete(self, buf: VersionBuffer) -> None:
        async with self._completing:
            try:
                layout = buf.layout()
                config = self.deliverer.model_config(buf)
                if config is not None:
                    check_trainer_layout(layout, config)
            except PlanError as exc:
                buf.ranks_done.clear()
                raise InvalidArgument(str(exc)) from None
            except Exception:
                buf.ranks_done.clear()
                raise
            self.store.completed(buf)
            metrics.VERSION_BYTES.labels(buf.run_id).set(buf.bytes_received)
            metrics.LATEST_VERSION.labels(buf.run_id).set(buf.version)
            log.info(
                "version %s complete: %d bytes from %d ranks", buf.version, buf.bytes_received, buf.world_size
            )
            if self.state is not None:
                await self.state.save_version(buf)
            self.deliverer.version_completed(buf, layout)

    async def RegisterTarget(self, request, context):
        target = target_from_request(request)
        self.deliverer.transports.check(target.transport)  # a kind this host cannot run is refused here
        config = self.deliverer.model_config(run_id=target.run_id or None)
        if request.model_config_json and config is None:
            config = ModelConfig.from_hf_dict(json.loads(request.model_config_json))
        if config is not None:
            try:
                target.layout.check(config)
            except ValueError as exc:
                raise InvalidArgument(f"layout: {exc}") from None
        old = self.deliverer.targets.get(target.deployment)
        if old is not None and old.layout == target.layout and old.endpoints == target.endpoints:
            target.version = old.version  # re-registration of the same deployment keeps its state
            target.state = old.state
        if old is not None and old.run_id != target.run_id and self.state is not None:
            await self.state.forget_target(old)  # its keys live under its former run's prefix
        self.deliverer.targets[target.deployment] = target
        placement = self.deliverer.placement
        placement.forget_except(e for t in self.deliverer.targets.values() for e in t.endpoints)
        await placement.place(target.endpoints)
        metrics.init_deployment(target.deployment, self.deliverer.reached_by(target))
        if self.state is not None:
            await self.state.save_target(target)
        versions = self.store.serving(target.run_id)
        latest = versions.latest
        if latest is not None and target.due(latest.version):
            self.deliverer.schedule(latest, force=target)
        return weightsync_pb2.RegisterTargetResponse(current_version=versions.latest_version)

    async def GetVersion(self, request, context):
        """With run_id: that run's latest version and its targets only. Without: every target, and
        the latest version of the config's default run, or of the only run when exactly one other
        run pushed (VersionStore.primary)."""
        placement = self.deliverer.placement
        targets = []
        for t in sorted(self.deliverer.targets.values(), key=lambda t: t.deployment):
            if request.run_id and t.run_id != request.run_id:
                continue
            proto = t.to_proto()
            proto.routes.extend(placement.to_proto(e, self.deliverer.shown_kind(t, e)) for e in t.endpoints)
            targets.append(proto)
        versions = self.store.serving(request.run_id) if request.run_id else self.store.primary()
        return weightsync_pb2.GetVersionResponse(
            latest_version=versions.latest_version,
            targets=targets,
            host_id=placement.host_id,
            latest_bytes_held=versions.latest_bytes_held,
        )

    async def UnregisterTarget(self, request, context):
        """Stop delivering to a deployment and forget it (KV too); when its run has no target left,
        the run's latest version's bytes are freed."""
        if not request.deployment:
            raise InvalidArgument("deployment: must not be empty")
        target = self.deliverer.unregister(request.deployment)
        if target is None:
            raise NotFound(f"deployment: {request.deployment!r} is not registered")
        if self.state is not None:
            await self.state.forget_target(target)
        if target.run_id and not any(t.run_id == target.run_id for t in self.deliverer.targets.values()):
            self.store.free(target.run_id)
        log.info("deployment %s unregistered (run %r)", target.deployment, target.run_id)
        return weightsync_pb2.UnregisterTargetResponse()

    async def RequestSync(self, request, context):
        target = self.deliverer.targets.get(request.deployment)
        if target is None:
            raise NotFound(
                f"deployment: {request.deployment!r} is not registered (call RegisterTarget first)"
            )
        versions = self.store.serving(target.run_id)
        latest = versions.latest
        if latest is None:
            if versions.latest_version >= 0:
                raise FailedPrecondition(
                    f"deployment: version {versions.latest_version} of run {versions.run_id!r} was published "
                    "before weight-sync restarted (or its last target left) and its bytes are gone; the next "
                    "trainer version will be delivered"
                )
            raise FailedPrecondition("deployment: no weight version has been pushed yet")
        target.version = min(target.version, latest.version - 1)  # the replica lost it: send again
        self.deliverer.schedule(latest, force=target)
        return weightsync_pb2.RequestSyncResponse(version=latest.version)


def _add_all(buf: VersionBuffer, rank: int, req) -> int:
    return sum(buf.add_chunk(rank, chunk, i) for i, chunk in enumerate(req.shards))
