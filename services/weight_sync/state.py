"""What survives a weight-sync restart: targets, synced versions and the latest manifest in the KV
bucket "weights" (see service.py), and the weights events on the bus."""

from __future__ import annotations

import json
import logging

from looprl.events.v1 import events_pb2
from looprl.weightsync.v1 import weightsync_pb2
from services.kit import subjects
from services.kit.run_errors import RunErrorReporter

from .deliver import Deliverer
from .targets import Target, kv_key, target_from_request
from .versions import VersionBuffer, VersionStore

log = logging.getLogger("looprl.weight_sync")


class StateStore:
    """Targets, versions and the latest manifest in the KV bucket "weights"; events on the bus."""

    def __init__(self, bus, kv, default_run: str) -> None:
        self.bus = bus
        self.kv = kv
        self.default_run = default_run
        # The run whose versions this weight-sync serves: learned from the trainer's pushes, since a
        # stack serves one run (the gateway refuses a second). Events go to that run's subject.
        self.current_run = default_run
        self.prefix = kv_key("run", default_run)  # one weight-sync per run: its keys live under it
        self.reporter = RunErrorReporter(bus, "weight-sync")

    async def save_target(self, t: Target) -> None:
        if t.registration is not None:
            await self.kv.put(
                f"{self.prefix}.{kv_key('target', t.deployment)}", t.registration.SerializeToString()
            )
        await self.save_state(t)

    async def save_state(self, t: Target) -> None:
        await self.kv.put(
            f"{self.prefix}.{kv_key('deployment', t.deployment)}", t.to_proto().SerializeToString()
        )

    async def save_version(self, buf: VersionBuffer) -> None:
        if buf.run_id:
            self.current_run = buf.run_id
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
        await self.kv.put(f"{self.prefix}.latest", json.dumps(manifest).encode())

    async def load(self, store: VersionStore, deliverer: Deliverer) -> None:
        raw = await self.kv.get(f"{self.prefix}.latest")
        if raw:
            manifest = json.loads(raw)
            store.latest_version = int(manifest["version"])
            if manifest.get("model_config_json"):
                deliverer.model_config(VersionBuffer(-1, 1, model_config_json=manifest["model_config_json"]))
        for key in await self.kv.keys():
            if not key.startswith(f"{self.prefix}.target."):
                continue
            reg = weightsync_pb2.RegisterTargetRequest.FromString(await self.kv.get(key))
            target = target_from_request(reg)
            state = await self.kv.get(f"{self.prefix}.{kv_key('deployment', target.deployment)}")
            if state:
                tv = weightsync_pb2.TargetVersion.FromString(state)
                target.version, target.state = tv.version, "ready" if tv.version >= 0 else "registered"
            deliverer.targets[target.deployment] = target
        log.info("restored %d targets, latest version %s", len(deliverer.targets), store.latest_version)

    async def failed(self, t: Target) -> None:
        """A delivery failed: the run is told which deployment and why (the target is retried)."""
        await self.save_state(t)
        await self.reporter.report(t.run_id or self.current_run, f"deployment {t.deployment}: {t.last_error}")

    async def rejected(self, t: Target, version: int, drift: float, detail: str) -> None:
        run = t.run_id or self.current_run
        event = events_pb2.WeightsRejected(
            run_id=run, version=version, deployment=t.deployment, drift=drift, detail=detail
        )
        await self.bus.publish(
            subjects.weights(run),
            event,
            msg_id=f"weights-rejected-{run}-{t.deployment}-{version}",
            headers={subjects.EVENT_HEADER: subjects.WEIGHTS_REJECTED},
        )
        await self.save_state(t)

    async def published(self, t: Target, version: int, nbytes: int, seconds: float) -> None:
        run = t.run_id or self.current_run
        event = events_pb2.WeightsPublished(
            run_id=run, version=version, deployment=t.deployment, sync_seconds=seconds, bytes=nbytes
        )
        await self.bus.publish(subjects.weights(run), event, msg_id=f"weights-{run}-{t.deployment}-{version}")
        await self.save_state(t)
