"""What survives a weight-sync restart: targets, synced versions and each run's latest manifest in
the KV bucket "weights" (see service.py), and the weights events on the bus.

Every run's keys live under its own prefix `run.<run>.`: a target's under the run it registered for
(a target of no run under the config's run), a version's manifest under the version's run. Events
go to the subject of the version's run."""

from __future__ import annotations

import json
import logging

from looprl.events.v1 import events_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit.bus import subjects
from services.kit.bus.client import EVENT_RETRY_S
from services.kit.messages.run_errors import RunErrorReporter

from .deliver import Deliverer
from .targets import Target, kv_key, target_from_request
from .versions import VersionBuffer, VersionStore

log = logging.getLogger("looprl.weight_sync")


class StateStore:
    """Targets, versions and each run's latest manifest in the KV bucket "weights"; events on the bus."""

    def __init__(self, bus, kv, default_run: str) -> None:
        self.bus = bus
        self.kv = kv
        self.default_run = default_run
        self.reporter = RunErrorReporter(bus, "weight-sync")

    def prefix(self, run_id: str) -> str:
        """The KV prefix of `run_id`'s keys (empty: the config's run)."""
        return kv_key("run", run_id or self.default_run)

    def _target_key(self, t: Target) -> str:
        return f"{self.prefix(t.run_id)}.{kv_key('target', t.deployment)}"

    def _state_key(self, t: Target) -> str:
        return f"{self.prefix(t.run_id)}.{kv_key('deployment', t.deployment)}"

    async def save_target(self, t: Target) -> None:
        if t.registration is not None:
            await self.kv.put(self._target_key(t), t.registration.SerializeToString())
        await self.save_state(t)

    async def save_state(self, t: Target) -> None:
        if t.removed:
            return  # a delivery that outlived UnregisterTarget must not bring its keys back
        await self.kv.put(self._state_key(t), t.to_proto().SerializeToString())

    async def forget_target(self, t: Target) -> None:
        """An unregistered target: its registration and synced version are dropped."""
        await self.kv.delete(self._target_key(t))
        await self.kv.delete(self._state_key(t))

    async def save_version(self, buf: VersionBuffer) -> None:
        manifest = {
            "version": buf.version,
            "run_id": buf.run_id,
            "bytes": buf.bytes_received,
            "trainer_world_size": buf.world_size,
            "model_config_json": buf.model_config_json,
            "params": {
                n: {"shape": list(s), "dtype": str(d).removeprefix("torch.")}
                for n, (s, d) in buf.params.items()
            },
        }
        await self.kv.put(f"{self.prefix(buf.run_id)}.latest", json.dumps(manifest).encode())

    async def load(self, store: VersionStore, deliverer: Deliverer) -> None:
        """Every run's latest version number (and model config) and every target with its synced
        version, whichever run they belong to."""
        saved = await self.kv.items("run.>")
        for key, raw in saved.items():
            if not key.endswith(".latest") or not raw:
                continue
            manifest = json.loads(raw)
            run = manifest.get("run_id") or self.default_run
            store.restored(run, int(manifest["version"]))
            if manifest.get("model_config_json"):
                deliverer.model_config(
                    VersionBuffer(-1, 1, run_id=run, model_config_json=manifest["model_config_json"])
                )
        for key, raw in saved.items():
            if ".target." not in key or not raw:
                continue
            target = target_from_request(weightsync_pb2.RegisterTargetRequest.FromString(raw))
            state = await self.kv.get(self._state_key(target))
            if state:
                tv = weightsync_pb2.TargetVersion.FromString(state)
                target.version, target.state = tv.version, "ready" if tv.version >= 0 else "registered"
            deliverer.targets[target.deployment] = target
        log.info(
            "restored %d targets; latest versions %s",
            len(deliverer.targets),
            {r: v.latest_version for r, v in store.runs.items()},
        )

    async def failed(self, t: Target, run_id: str) -> None:
        """A delivery failed: the run is told which deployment and why (the target is retried)."""
        await self.save_state(t)
        run = run_id or t.run_id or self.default_run
        await self.reporter.report(run, f"deployment {t.deployment}: {t.last_error}")

    async def rejected(self, t: Target, run_id: str, version: int, drift: float, detail: str) -> None:
        run = run_id or t.run_id or self.default_run
        event = events_pb2.WeightsRejected(
            run_id=run, version=version, deployment=t.deployment, drift=drift, detail=detail
        )
        await self.bus.publish_retrying(
            subjects.weights(run),
            event,
            msg_id=f"weights-rejected-{run}-{t.deployment}-{version}",
            headers={subjects.EVENT_HEADER: subjects.WEIGHTS_REJECTED},
            within_s=EVENT_RETRY_S,
        )
        await self.save_state(t)

    async def published(self, t: Target, run_id: str, version: int, nbytes: int, seconds: float) -> None:
        run = run_id or t.run_id or self.default_run
        event = events_pb2.WeightsPublished(
            run_id=run, version=version, deployment=t.deployment, sync_seconds=seconds, bytes=nbytes
        )
        # Retried through a nats-server restart: the event is how the router hears of the commit at
        # once and the run records the delivery; nothing publishes a lost one again.
        await self.bus.publish_retrying(
            subjects.weights(run),
            event,
            msg_id=f"weights-{run}-{t.deployment}-{version}",
            within_s=EVENT_RETRY_S,
        )
        await self.save_state(t)
