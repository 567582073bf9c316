"""Delivering versions to targets: plan, stage on every rank, commit on every rank, publish.

For a version, the due targets are grouped by layout; every (layout, rank, transport) group gets ONE
bucket stream, fanned out to the group's receivers. The transport of a rank is its target's
weight_transport resolved by transport/factory.py against placement.py's verdict: with auto, shared
memory for receivers proven to be on this host (the bucket is written once and read by all of them)
and gRPC otherwise (the same encoded bytes sent to each).
All ranks of all groups stage concurrently. Targets on different hosts (by the host identities
their ranks report) are separate deliveries: a host that disappears mid-stream (its link down, no
connection refused, only silence until stage_timeout_s) stalls the delivery to its own targets,
never the commit of a version on the other hosts. A deployment commits only when every one of its ranks
staged the version completely and verified; otherwise all its ranks abort, it keeps serving v-1,
and the delivery is retried (or superseded by a newer version). After the commit:
WeightsPublished{version, deployment} on the bus and the target's state in KV.

Canary targets (canary.py, deliver_canary.py): when everything is staged, the first replica commits
alone, answers the golden prompts, and the rest commit only if its log-prob drift is within bound;
otherwise it rolls back to the version it served before and the version is not retried for that
target.

Runs: a version goes to the targets registered for its run and to those registered for no run.
An unregistered target gets nothing more: a delivery to it alone is cancelled, one it shares goes
on for the others and commits nothing on it.

Pipelining: with `pipeline`, a version's delivery starts when its first chunk arrives, planned
from the previous version's trainer layout; each bucket is sent as soon as its chunks are in.
If the version completes in a different layout, the speculative delivery is cancelled (the
receivers abort) and redone with the right plan.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace

from looprl.inference.v1 import inference_pb2
from services.kit.telemetry import tracing as telemetry
from services.modeling.config import ModelConfig
from services.weight_sync.transport import Delivery, Endpoint, StageResult
from services.weight_sync.transport.factory import Transports, TransportSettings
from services.weights import DeliveryError

from . import metrics
from .deliver_canary import CanaryCommits
from .placement import Placement
from .plan import PlanCache, RankPlan, TrainerLayout
from .planned_bucket import PlannedBucket
from .targets import Target
from .versions import VersionBuffer, VersionStore

log = logging.getLogger("looprl.weight_sync")
_tracer = trace.get_tracer("looprl.weight_sync.deliver")

# Every hook gets the run of the version concerned: its events go to that run's subject.
PublishHook = Callable[[Target, str, int, int, float], Awaitable[None]]  # target, run, version, bytes, s
RejectHook = Callable[[Target, str, int, float, str], Awaitable[None]]  # target, run, version, drift, detail
FailHook = Callable[[Target, str], Awaitable[None]]  # target, run (its last_error says why)


def _commits_alone(receivers: list[Endpoint], targets: list[Target]) -> bool:
    """Whether the one receiver of a delivery may commit the version itself once it holds it
    verified (one call less between the trainer's push and generation): it is its replica's only
    rank, shares no bytes with another receiver, and no canary checks it first."""
    if len(receivers) != 1:
        return False
    owner = next(t for t in targets if receivers[0] in t.endpoints)
    return len(owner.endpoints) == 1 and not owner.canary


def _by_host(targets: list[Target]) -> list[list[Target]]:
    """`targets` grouped by the hosts their ranks are on, each group one delivery: targets on one
    host share its shared-memory buckets and its fate."""
    groups: dict[frozenset[str], list[Target]] = {}
    for t in targets:
        groups.setdefault(frozenset(e.host_id for e in t.endpoints), []).append(t)
    return list(groups.values())


class Deliverer(CanaryCommits):
    def __init__(
        self,
        store: VersionStore,
        *,
        bucket_bytes: int = 32 << 20,
        shm_segments: int = 3,
        shared_copy_min_receivers: int = 2,
        shared_copies: int = 3,
        prefetch: int = 2,
        retry_attempts: int = 3,
        retry_backoff_s: float = 0.5,
        stage_timeout_s: float = 600.0,
        pipeline: bool = True,
        canary_tokens: int = 8,
        canary_max_drift: float = 0.5,
        on_published: PublishHook | None = None,
        on_failed: FailHook | None = None,
        on_rejected: RejectHook | None = None,
        host_id: str = "",
    ) -> None:
        self.store = store
        self.targets: dict[str, Target] = {}
        self.plans = PlanCache()
        self.bucket_bytes = bucket_bytes
        self.transports = Transports(
            TransportSettings(
                bucket_bytes=bucket_bytes,
                shm_segments=shm_segments,
                prefetch=prefetch,
                shared_copy_min_receivers=shared_copy_min_receivers,
                shared_copies=shared_copies,
            )
        )
        self.grpc = self.transports.control  # commit, abort, status and probes, whatever the transport
        self.placement = Placement(self.grpc.stub, host_id=host_id)
        self.retry_attempts = retry_attempts
        self.retry_backoff_s = retry_backoff_s
        self.stage_timeout_s = stage_timeout_s
        self.pipeline = pipeline
        self.canary_tokens = canary_tokens
        self.canary_max_drift = canary_max_drift
        self.on_published = on_published
        self.on_failed = on_failed  # a delivery to the target failed (its last_error says why)
        self.on_rejected = on_rejected
        self._tasks: set[asyncio.Task] = set()
        self._busy: dict[str, int] = {}  # deployment -> version being delivered
        self._delivering: dict[asyncio.Task, list[Target]] = {}  # running deliveries and their targets
        # Per run: the speculative deliveries of a version, the last trainer layout, the model config
        # (runs may train different models).
        self._speculative: dict[tuple[str, int], tuple[str, list[asyncio.Task]]] = {}
        self._last_layout: dict[str, TrainerLayout] = {}
        self._configs: dict[str, tuple[str, ModelConfig]] = {}
        self._config_run = ""  # the run whose config was seen last: the fallback of a run that sent none

    # --------------------------------------------------------- transports
    def kind_for(self, t: Target, ep: Endpoint) -> str:
        """The transport kind that reaches rank `ep` of target `t` (DeliveryError when its
        weight_transport cannot reach it, e.g. shm for a rank on another host)."""
        return self.transports.resolve(
            t.transport, co_located=self.placement.uses_shm(ep), why=self.placement.reason(ep)
        )

    def shown_kind(self, t: Target, ep: Endpoint) -> str:
        """`kind_for`, or the kind the target names when it cannot reach `ep` (status, metrics)."""
        try:
            return self.kind_for(t, ep)
        except DeliveryError:
            return t.transport

    def reached_by(self, t: Target) -> str:
        """How the target is reached, for metrics: a kind, or mixed."""
        return metrics.transport(self.shown_kind(t, e) for e in t.endpoints)

    # ------------------------------------------------------------ events
    def model_config(self, buf: VersionBuffer | None = None, run_id: str | None = None) -> ModelConfig | None:
        """The model of `buf`'s run (learning it from buf), or of `run_id`; a run that sent no config
        (or no run named) gets the config seen last."""
        if buf is not None:
            run_id = buf.run_id
            known = self._configs.get(run_id)
            if buf.model_config_json and (known is None or known[0] != buf.model_config_json):
                config = ModelConfig.from_hf_dict(json.loads(buf.model_config_json))
                self._configs[run_id] = (buf.model_config_json, config)
                self._config_run = run_id
        entry = self._configs.get(run_id) if run_id is not None else None
        entry = entry or self._configs.get(self._config_run)
        return entry[1] if entry is not None else None

    def _config_json(self, run_id: str) -> str:
        entry = self._configs.get(run_id) or self._configs.get(self._config_run)
        return entry[0] if entry is not None else ""

    def _receivers(self, buf: VersionBuffer) -> list[Target]:
        """The registered targets buf's run delivers to."""
        return [t for t in self.targets.values() if t.receives(buf.run_id)]

    def version_started(self, buf: VersionBuffer) -> None:
        """First chunk of a version: deliver speculatively with the previous layout's plan."""
        layout = self._last_layout.get(buf.run_id)
        if not self.pipeline or layout is None or self.model_config(buf) is None:
            return
        due = [t for t in self._receivers(buf) if t.due(buf.version) and t.deployment not in self._busy]
        if due:
            tasks = [self._spawn(self._deliver(buf, group, layout)) for group in _by_host(due)]
            self._speculative[(buf.run_id, buf.version)] = (layout.signature, tasks)

    def version_completed(self, buf: VersionBuffer, layout: TrainerLayout) -> None:
        self.model_config(buf)
        self._last_layout[buf.run_id] = layout
        spec = self._speculative.pop((buf.run_id, buf.version), None)
        if spec is not None and spec[0] != layout.signature:
            for task in spec[1]:
                task.cancel()  # planned from a different layout: redo below
        self.schedule(buf)

    def schedule(self, buf: VersionBuffer, force: Target | None = None) -> None:
        """Deliver buf to every due target of its run that is not already receiving it."""
        if force is not None:
            registered = self.targets.get(force.deployment) is force and force.receives(buf.run_id)
            targets = [force] if registered and self._busy.get(force.deployment) != buf.version else []
        else:
            targets = [
                t
                for t in self._receivers(buf)
                if t.due(buf.version) and self._busy.get(t.deployment, -1) < buf.version
            ]
        targets = [t for t in targets if t.deployment not in self._busy]
        for group in _by_host(targets):
            self._spawn(self._deliver(buf, group, None, forced=force is not None))

    # ---------------------------------------------------------- delivery
    async def _deliver(
        self,
        buf: VersionBuffer,
        targets: list[Target],
        speculative: TrainerLayout | None,
        forced: bool = False,
    ) -> None:
        """One delivery, its own trace: linked to the trainer's pushes of the version (its step)."""
        links, _ = telemetry.links(buf.pushes)
        with _tracer.start_as_current_span(
            "weight-sync deliver",
            context=telemetry.new_trace(),
            links=links,
            attributes={
                telemetry.ATTR.RUN_ID: buf.run_id,
                telemetry.ATTR.WEIGHT_VERSION: buf.version,
                telemetry.ATTR.DEPLOYMENT: ",".join(t.deployment for t in targets),
                "looprl.speculative": speculative is not None,
            },
        ):
            task = asyncio.current_task()
            self._delivering[task] = targets
            try:
                await self._deliver_traced(buf, targets, speculative, forced)
            finally:
                self._delivering.pop(task, None)

    def unregister(self, deployment: str) -> Target | None:
        """Stop delivering to `deployment`: a delivery to it alone is cancelled (its ranks abort), one
        shared with other targets goes on for them and skips it."""
        target = self.targets.pop(deployment, None)
        if target is None:
            return None
        target.removed = True
        for task, targets in list(self._delivering.items()):
            if target in targets and all(t.removed for t in targets):
                task.cancel()
        self.placement.forget_except(e for t in self.targets.values() for e in t.endpoints)
        metrics.forget_deployment(deployment)
        return target

    async def _deliver_traced(
        self, buf: VersionBuffer, targets: list[Target], speculative: TrainerLayout | None, forced: bool
    ) -> None:
        version = buf.version
        for t in targets:
            self._busy[t.deployment] = version
            t.state = "syncing"
        buf.hold()  # the arena's bytes stay put while receivers read them
        try:
            trainer_layout = speculative or buf.layout()
            config = self.model_config(buf)
            config_json = self._config_json(buf.run_id)
            if config is None:
                raise DeliveryError(
                    f"version {version}: no model config pushed (model_config_json) and none known"
                )
            start = time.perf_counter()
            await self.placement.place(e for t in targets for e in t.endpoints)
            kinds: dict[Endpoint, str] = {}
            reachable: list[Target] = []
            for t in targets:
                try:
                    kinds.update({e: self.kind_for(t, e) for e in t.endpoints})
                    reachable.append(t)
                except DeliveryError as exc:  # this target only: its transport cannot reach a rank
                    await self._failed(t, buf, f"{t.deployment}: {exc}", buf.run_id)
            skip = await self._ranks_already_at(version, reachable) if forced else set()
            jobs = []
            by_layout: dict[object, list[Target]] = {}
            for t in reachable:
                by_layout.setdefault(t.layout, []).append(t)
            for layout, group in by_layout.items():
                plan = self.plans.get(trainer_layout, config, layout, self.bucket_bytes)
                for rank_plan in plan.ranks:
                    by_kind: dict[str, list[Endpoint]] = {}
                    for t in group:
                        for e in t.endpoints:
                            if e.rank == rank_plan.rank and e not in skip:
                                by_kind.setdefault(kinds[e], []).append(e)
                    for kind, subset in by_kind.items():
                        jobs.append(
                            self.transports.get(kind).stage(
                                Delivery(
                                    version,
                                    self._buckets(rank_plan, buf),
                                    total_bytes=rank_plan.nbytes,
                                    model_config_json=config_json,
                                    timeout_s=self.stage_timeout_s,
                                    commit=_commits_alone(subset, group),
                                    adapter=subset[0].adapter,
                                ),
                                subset,
                            )
                        )
            results: dict[Endpoint, StageResult] = {}
            for res in await asyncio.gather(*jobs):
                results.update(res)
            for ep, res in results.items():
                self.placement.delivered(ep, res.bytes_sent, kinds[ep])
            await asyncio.gather(*(self._finish(t, buf, results, skip, start) for t in reachable))
        except asyncio.CancelledError:
            await asyncio.gather(*(self.grpc.abort(e, version) for t in targets for e in t.endpoints))
            for t in targets:
                t.state = "ready" if t.version >= 0 else "registered"
            raise
        except Exception as exc:
            log.warning("delivery of version %s failed: %s", version, exc)
            for t in targets:
                await self._failed(t, buf, str(exc), buf.run_id)
        finally:
            buf.release()
            for t in targets:
                if self._busy.get(t.deployment) == version:
                    del self._busy[t.deployment]
            self._forget_speculative(buf.run_id, version)
            self._after(targets)

    def _forget_speculative(self, run_id: str, version: int) -> None:
        """This delivery is over: the others of the version (other hosts) may still be cancelled."""
        spec = self._speculative.get((run_id, version))
        if spec is None:
            return
        others = [task for task in spec[1] if task is not asyncio.current_task()]
        if others:
            self._speculative[(run_id, version)] = (spec[0], others)
        else:
            del self._speculative[(run_id, version)]

    async def _buckets(self, rank_plan: RankPlan, buf: VersionBuffer):
        for spec in rank_plan.buckets:
            if not buf.complete:
                await buf.wait_for(spec.chunk_keys)
            yield PlannedBucket(spec, rank_plan.dtype, buf.chunks, buf.locations, buf.sums)

    async def _ranks_already_at(self, version: int, targets: list[Target]) -> set[Endpoint]:
        """A restarted rank asks for the version its peers already serve: only it needs the bytes."""

        async def at(ep: Endpoint) -> Endpoint | None:
            try:
                status = await self.grpc.stub(ep.address).Status(inference_pb2.StatusRequest(), timeout=10)
            except grpc.aio.AioRpcError:
                return None
            # A LoRA target's receiver serves the run's adapter beside its own weights.
            served = status.adapter_versions.get(ep.adapter, -1) if ep.adapter else status.weight_version
            return ep if served >= version else None

        found = await asyncio.gather(*(at(e) for t in targets for e in t.endpoints))
        return {e for e in found if e is not None}

    async def _finish(
        self,
        t: Target,
        staged: VersionBuffer,
        results: dict[Endpoint, StageResult],
        skip: set[Endpoint],
        start: float,
    ) -> None:
        version, run_id = staged.version, staged.run_id
        if t.removed:  # unregistered while its bytes were on the way: nothing to commit or report
            await asyncio.gather(*(self.grpc.abort(e, version) for e in t.endpoints if e not in skip))
            return
        errors = [str(results[e].error) for e in t.endpoints if e in results and results[e].error is not None]
        buf = self._buffer(run_id, version)
        if errors:
            await asyncio.gather(*(self.grpc.abort(e, version) for e in t.endpoints if e not in skip))
            await self._failed(t, buf, "; ".join(errors), run_id)
            return
        first = [e for e in t.replicas[0] if e not in skip] if t.canary and t.version >= 0 else []
        if len(first) != len(t.replicas[0]):
            first = []  # no previous version to compare with, or the first replica already has this one
        if first and not await self._canary(t, staged, first, skip):
            return
        committed = {e for e in t.endpoints if e in results and results[e].serving_version >= version}
        try:
            await asyncio.gather(
                *(
                    self.grpc.commit(e, version)
                    for e in t.endpoints
                    if e not in skip and e not in first and e not in committed
                )
            )
        except DeliveryError as exc:
            # Staged and verified everywhere, so a commit fails only if a replica died; its peers may
            # have switched. The replica must RequestSync when it comes back (documented).
            await self._failed(t, buf, str(exc), run_id)
            return
        t.version = version
        t.state = "ready"
        t.last_error = ""
        t.last_bytes = sum(results[e].bytes_sent for e in t.endpoints if e in results)
        t.last_sync_seconds = time.perf_counter() - start
        reached_by = self.reached_by(t)
        metrics.delivered(run_id, t.deployment, version, t.last_sync_seconds, reached_by)
        t.attempts.pop(version, None)
        log.info(
            "deployment %s now serves version %s (%d bytes, %.3fs)",
            t.deployment,
            version,
            t.last_bytes,
            t.last_sync_seconds,
        )
        if self.on_published is not None:
            try:
                await self.on_published(t, run_id, version, t.last_bytes, t.last_sync_seconds)
            except Exception as exc:
                log.warning("publishing version %s for %s failed: %s", version, t.deployment, exc)

    def _buffer(self, run_id: str, version: int) -> VersionBuffer | None:
        """The run's latest complete version when it is `version` (what a failed delivery retries)."""
        latest = self.store.run(run_id).latest
        return latest if latest is not None and latest.version == version else None

    async def _failed(self, t: Target, buf: VersionBuffer | None, error: str, run_id: str = "") -> None:
        if t.removed:
            return  # unregistered: its failure is nobody's concern, and it is not retried
        run_id = run_id or (buf.run_id if buf is not None else "")
        t.state = "failed"
        metrics.failed(t.deployment)
        t.last_error = error
        if self.on_failed is not None:
            try:
                await self.on_failed(t, run_id)
            except Exception:
                pass
        if buf is None or not buf.complete:
            return
        attempt = t.attempts.get(buf.version, 0) + 1
        t.attempts[buf.version] = attempt
        if attempt >= self.retry_attempts:
            log.warning(
                "giving up on version %s for %s after %d attempts: %s",
                buf.version,
                t.deployment,
                attempt,
                error,
            )
            return

        async def retry() -> None:
            await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            latest = self.store.run(buf.run_id).latest
            current = self.targets.get(t.deployment)  # re-registered meanwhile: the new registration
            if current is None or latest is None:
                return
            if latest.version >= buf.version and current.version < latest.version:
                self.schedule(latest, force=current)

        self._spawn(retry())

    def _after(self, targets: list[Target]) -> None:
        """A target that missed versions while busy catches up with the latest one of its run."""
        for done in targets:
            t = self.targets.get(done.deployment)  # re-registered meanwhile: the new registration
            latest = self.store.serving(t.run_id).latest if t is not None else None
            if t is None or latest is None:
                continue
            if t.state != "failed" and t.due(latest.version) and t.deployment not in self._busy:
                self.schedule(latest, force=t)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def idle(self, timeout_s: float = 60.0) -> None:
        """Until no delivery is running (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - time.monotonic()))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.transports.close()
        self.store.close()
