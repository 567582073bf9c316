"""GatewayService: create, inspect, watch and stop runs; the run manager behind it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from gateway.admission import Demand, Peers, admit, check_cluster, check_quota, run_demand
from gateway.auth import TokenAuth
from gateway.config import Tenant, tokens_tenant
from gateway.evaluation import evaluation_to_proto
from gateway.queue import QUEUED, STARTED, ClusterResources, Waiting, plan, queue_order
from gateway.resample import RESAMPLED_KEY
from gateway.run_store import ACTIVE, EVALUATED_KEY, FINAL, RunStore, new_run_id
from gateway.runs import RUN_TRACE_KEY, RunDriver
from gateway.stalls import LAST_ERROR_KEY, STALLED_KEY
from gateway.task_code import DATASET_KEY, load_task_code
from looprl.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.limits import RecipeLimits
from services.kit.config.recipe import RecipeError, RunRecord, parse_recipe
from services.kit.rpc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.kit.telemetry import tracing as telemetry

log = logging.getLogger("looprl.gateway")

# How long StopRun waits for the run's driver to end (the run is stopped in its record before).
STOP_DRIVER_S = 10.0
# RunRecord.extra key: the run is served by the router's configured deployments, not its own.
STATIC_DEPLOYMENTS_KEY = "static_deployments"

STATES = {
    "queued": gateway_pb2.RUN_STATE_QUEUED,
    "pending": gateway_pb2.RUN_STATE_PENDING,
    "running": gateway_pb2.RUN_STATE_RUNNING,
    "stopping": gateway_pb2.RUN_STATE_STOPPING,
    "completed": gateway_pb2.RUN_STATE_COMPLETED,
    "failed": gateway_pb2.RUN_STATE_FAILED,
    "stopped": gateway_pb2.RUN_STATE_STOPPED,
}


# The fields of a samples row (services/kit/messages/packer_reports.py) that a SampleCompletion holds.
SAMPLE_FIELDS = tuple(gateway_pb2.SampleCompletion.DESCRIPTOR.fields_by_name)


@functools.lru_cache(maxsize=1024)
def recipe_facts(recipe_toml: str) -> tuple[int, int]:
    """(run.steps, logging.samples_every) of a recorded recipe; (0, 0) for one this gateway cannot
    parse. Parsed once per recipe: a run's recipe never changes, and its Run is built at every
    WatchRun poll (twice a second per watcher) and for every run ListRuns lists."""
    try:
        recipe = parse_recipe(recipe_toml, limits=RecipeLimits.ceilings())
    except RecipeError:
        return 0, 0
    return recipe.run.steps, recipe.logging.samples_every


def run_to_proto(
    record: RunRecord,
    history: Sequence[dict] = (),
    weight_syncs: Sequence[dict] = (),
    queued: tuple[int, str] = (0, ""),
    evaluations: Sequence[dict] = (),
    samples: Sequence[dict] = (),
) -> gateway_pb2.Run:
    """The public Run: the record, plus its per-step history, weight deliveries, (queue position,
    why it waits) and sample tables when given (RunManager.proto finds them)."""
    extra = record.extra
    run = gateway_pb2.Run(
        run_id=record.run_id,
        state=STATES.get(record.state, gateway_pb2.RUN_STATE_UNSPECIFIED),
        recipe_toml=record.recipe_toml,
        step=record.step,
        weight_version=record.weight_version,
        episodes_published=record.episodes_published,
        rollouts_trained=int(extra.get("rollouts_trained", 0)),
        error=record.error,
        tenant=record.tenant,
    )
    if record.state == QUEUED:
        run.queue_position, run.queued_reason = queued
    run.total_steps = recipe_facts(record.recipe_toml)[0]
    for name, version in sorted(extra.get("deployments", {}).items()):
        run.deployments.add(deployment=name, version=int(version))
    for h in history:
        run.history.add(
            step=h["step"],
            reward_mean=h["reward_mean"],
            reward_std=h["reward_std"],
            loss=h["loss"],
            mean_staleness=h["mean_staleness"],
            train_tokens_per_second=h["train_tokens_per_second"],
            num_rollouts=h["num_rollouts"],
            seconds=h["seconds"],
            max_staleness=h.get("max_staleness", 0),
            # Entries written before these were recorded read as zeros.
            clip_fraction=h.get("clip_fraction", 0.0),
            kl=h.get("kl", 0.0),
            entropy=h.get("entropy", 0.0),
            grad_norm=h.get("grad_norm", 0.0),
            mean_response_tokens=h.get("mean_response_tokens", 0.0),
            unix_time=h.get("at", 0.0),
            importance_ratio_mean=h.get("importance_ratio_mean", 0.0),
            importance_ratio_max=h.get("importance_ratio_max", 0.0),
            importance_ratio_min=h.get("importance_ratio_min", 0.0),
            importance_ratio_clipped=h.get("importance_ratio_clipped", 0.0),
            resampled_groups=h.get("resampled_groups", 0),
        )
    for w in weight_syncs:
        run.weight_syncs.add(
            deployment=w["deployment"], version=w["version"], sync_seconds=w["sync_seconds"], bytes=w["bytes"]
        )
    for row in samples:
        run.samples.add(**{name: row[name] for name in SAMPLE_FIELDS if name in row})
    run.resampled_groups = int(extra.get(RESAMPLED_KEY, 0))
    for reason, count in extra.get("dropped", {}).items():
        run.rollouts_dropped[reason] = int(count)
    for evaluation in evaluations:
        run.evaluations.append(evaluation_to_proto(evaluation))
    if extra.get(DATASET_KEY):
        d = extra[DATASET_KEY]
        run.dataset.CopyFrom(
            gateway_pb2.RunDataset(
                **{k: v for k, v in d.items() if k in gateway_pb2.RunDataset.DESCRIPTOR.fields_by_name}
            )
        )
    run.duplicate_deliveries = int(extra.get("duplicate_deliveries", 0))
    run.step_records_ignored = int(extra.get("step_records_ignored", 0))
    if record.state == "running" and extra.get(STALLED_KEY):
        run.state = gateway_pb2.RUN_STATE_STALLED
        run.stalled_reason = extra[STALLED_KEY]
    error = extra.get(LAST_ERROR_KEY)
    if error:
        run.last_error.component = error["component"]
        run.last_error.message = error["message"]
        run.last_error.occurrences = int(error.get("occurrences", 1))
        run.last_error.unix_time = float(error.get("unix_time", 0.0))
    return run


class RunManager:
    """Owns the RunDrivers of this gateway process and the run queue (gateway/queue.py); resumes active
    runs and the queue on start."""

    def __init__(
        self,
        bus: Bus,
        store: RunStore,
        recipe_base_dir: Path,
        packer=None,
        limits: RecipeLimits | None = None,
        peers: Peers | None = None,
        tenants: dict[str, Tenant] | None = None,
        cluster: ClusterResources | None = None,
        path_roots: tuple[Path, ...] = (),
    ) -> None:
        self.bus, self.store, self.base_dir, self.packer = bus, store, recipe_base_dir, packer
        self.path_roots = path_roots  # where recipes' model directories may lie (none: anywhere)
        self.limits = limits or RecipeLimits()
        self.peers = peers or Peers()
        self.tenants = tenants or {}  # by name: the quota and priority of a queued run's tenant
        self.cluster = cluster or ClusterResources("")
        self.drivers: dict[str, RunDriver] = {}
        self._demands: dict[str, Demand] = {}  # by run id (a run's recipe never changes)
        self._admitting: set[asyncio.Task] = set()
        # Admission decisions and the records they write are one step: two CreateRuns of a tenant at
        # its last free slot must not both start, nor a queued run start twice.
        self._admission = asyncio.Lock()

    async def proto(
        self, record: RunRecord, queue: dict[str, tuple[int, str]] | None = None
    ) -> gateway_pb2.Run:
        if record.state == QUEUED and queue is None:
            queue = await self.queue()
        every = recipe_facts(record.recipe_toml)[1]
        return run_to_proto(
            record,
            await self.store.history(record),
            await self.store.weight_syncs(record),
            (queue or {}).get(record.run_id, (0, "")),
            await self.store.evaluations(record) if record.extra.get(EVALUATED_KEY) else (),
            await self.store.samples(record, every),
        )

    async def watch(
        self, run_id: str, tenant: Tenant, period_s: float = 0.5
    ) -> AsyncIterator[gateway_pb2.Run]:
        """The run now, then each time it changes, until it has ended (NotFound for no such run, or
        one the tenant may not see)."""
        record = await self.get(run_id, tenant)
        last = None
        while True:
            snapshot = await self.proto(record)
            if snapshot != last:
                yield snapshot
                last = snapshot
            if record.state in FINAL:
                return
            await asyncio.sleep(period_s)
            record = await self.get(run_id, tenant)

    async def resume(self) -> None:
        """Drive the runs a previous gateway process started, then start the queued runs that fit."""
        for record in await self.store.list():
            if record.state in ACTIVE:
                log.info("resuming run %s at step %d", record.run_id, record.step)
                self._drive(record.run_id)
        await self._admit_logged()  # a cluster not answering yet: the periodic pass starts them

    def _drive(self, run_id: str) -> None:
        driver = RunDriver(
            self.bus, self.store, run_id, self.packer, self.peers.not_serving, sandbox=self.peers.sandbox
        )
        driver.on_end = self._ended
        self.drivers[run_id] = driver
        driver.start()

    def _ended(self, run_id: str) -> None:
        """A driver ended with its run: its resources are free for the queue."""
        self.drivers.pop(run_id, None)
        self.store.forget(run_id)
        task = asyncio.create_task(self._admit_logged(), name=f"admit-after-{run_id}")
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    async def list(self, tenant: Tenant) -> list[RunRecord]:
        """The runs the tenant may see (every run for an admin), oldest first."""
        return [r for r in await self.store.list() if tenant.sees(r.tenant)]

    def _demand(self, record: RunRecord) -> Demand:
        demand = self._demands.get(record.run_id)
        if demand is None:
            try:
                demand = run_demand(record.recipe())
            except RecipeError:
                demand = Demand(())  # not a recipe this gateway admitted: it holds nothing it can name
            if record.extra.get(STATIC_DEPLOYMENTS_KEY):
                demand = demand.without_deployments()
            self._demands[record.run_id] = demand
        return demand

    def _tenant(self, name: str) -> Tenant:
        """The configured tenant; one no longer configured (its runs started before it was removed) keeps
        no quota and the default priority."""
        return self.tenants.get(name) or tokens_tenant().model_copy(update={"name": name, "priority": 0})

    def _waiting(self, records: list[RunRecord], caller: Tenant | None = None) -> list[Waiting]:
        """The queued runs among `records`, each with its tenant (the caller's own, as it called)."""

        def tenant_of(name: str) -> Tenant:
            return caller if caller is not None and caller.name == name else self._tenant(name)

        return [Waiting(r, tenant_of(r.tenant), self._demand(r)) for r in records if r.state == QUEUED]

    async def _plan(
        self, records: list[RunRecord], caller: Tenant | None = None
    ) -> list[tuple[Waiting, str]]:
        started = [r for r in records if r.state in STARTED]
        cluster = await self.cluster.state()
        total, in_use = (cluster.total, cluster.in_use) if cluster is not None else (None, None)
        return plan(self._waiting(records, caller), started, self._demand, total, in_use)

    async def queue(self) -> dict[str, tuple[int, str]]:
        """(position, 1 = next; why it waits) of every queued run, by run id."""
        records = await self.store.list()
        try:
            planned = await self._plan(records)
        except Unavailable as exc:  # the cluster's resources unknown: every queued run waits for them
            waiting = queue_order(self._waiting(records))
            planned = [(w, f"waits for the cluster: {exc.message}") for w in waiting]
        out = {}
        for position, (w, reason) in enumerate(planned, start=1):
            out[w.record.run_id] = (position, reason or "starting: it fits now")
        return out

    async def admit_queued(self) -> None:
        """End the queued runs of tenants no longer configured, then start those that fit now, in
        queue order."""
        async with self._admission:
            records = await self.store.list()
            revoked = [r for r in records if r.state == QUEUED and r.tenant not in self.tenants]
            for record in revoked:
                await self._refuse_queued(record.run_id, record.tenant)
            if revoked:
                records = await self.store.list()
            if not any(r.state == QUEUED for r in records):
                return  # nothing waits: no need to ask the cluster (a fresh stack's head may not answer yet)
            for w, reason in await self._plan(records):
                if not reason:
                    await self._start_queued(w.record.run_id)

    async def _refuse_queued(self, run_id: str, tenant: str) -> None:
        """A revoked tenant's queued run never starts: nothing would bound what it uses."""

        def refuse(record: RunRecord) -> None:
            if record.state == QUEUED:
                record.state = "failed"
                record.error = f"tenant {tenant!r} is no longer configured: its queued run does not start"

        await self.store.update(run_id, refuse)
        log.warning("run %s: tenant %r is no longer configured; the queued run is failed", run_id, tenant)

    async def _start_queued(self, run_id: str) -> None:
        def start(record: RunRecord) -> None:
            if record.state == QUEUED:  # a StopRun since the plan keeps it stopped
                record.state = "pending"

        if (await self.store.update(run_id, start)).state == "pending" and run_id not in self.drivers:
            log.info("run %s leaves the queue", run_id)
            self._drive(run_id)

    async def _admit_logged(self) -> None:
        """admit_queued where a failure must not fail the caller (a StopRun that already stopped its
        run, a driver's end): the periodic pass retries."""
        try:
            await self.admit_queued()
        except Exception:
            log.exception("queued runs not admitted")

    async def admit_forever(self, period_s: float = 5.0) -> None:
        """Re-plan the queue periodically: the cluster may grow, or a run end outside this process."""
        while True:
            await asyncio.sleep(period_s)
            await self._admit_logged()

    async def create(self, recipe_toml: str, run_id: str, tenant: Tenant) -> RunRecord:
        """Admit a run of `tenant`: every check (recipe bounds, the tenant's per-run quota, the cluster's
        total resources, the services' prerequisites) passes before its record is written; it then
        starts ("pending") if it fits now, else waits ("queued")."""
        try:
            recipe = parse_recipe(
                recipe_toml, base_dir=self.base_dir, limits=self.limits, path_roots=self.path_roots
            )
        except RecipeError as exc:
            raise InvalidArgument(f"recipe_toml: {exc}") from exc
        if run_id:
            try:
                subjects.validate_run_id(run_id)
            except ValueError as exc:
                raise InvalidArgument(f"run_id: {exc}") from exc
        demand = run_demand(recipe)
        check_quota(demand, tenant)
        if tenant.max_concurrent_runs == 0:  # it would wait forever
            raise ResourceExhausted(f"run: tenant {tenant.name!r} has the quota max_concurrent_runs=0")
        total = await self.cluster.total()
        if total is not None:
            check_cluster(demand, total)
        shared = await admit(recipe, self.peers, self.base_dir)
        loaded = await load_task_code(recipe, self.peers, self.base_dir)
        async with self._admission:
            if shared:
                await self._refuse_sharing(tenant)
            return await self._create(recipe_toml, recipe, run_id, tenant, demand, shared, loaded)

    async def _refuse_sharing(self, tenant: Tenant) -> None:
        """A router that serves only its configured deployments holds one run's weights, numbered
        by that run: a second run on them would sample the first one's policy, so it is refused."""
        records = await self.store.list()
        if not records:
            return
        last = records[-1]
        # Another tenant's run is not named: its id and state are not the caller's to see.
        served = f"run {last.run_id!r} ({last.state})" if tenant.sees(last.tenant) else "another tenant's run"
        raise FailedPrecondition(
            f"deployments: this stack's inference-router serves only its configured deployments, which "
            f"served {served}; one run per such stack (a stack started without a recipe gives every run "
            "deployments of its own)"
        )

    async def _create(
        self,
        recipe_toml: str,
        recipe,
        run_id: str,
        tenant: Tenant,
        demand: Demand,
        shared: bool,
        extra: dict | None = None,
    ) -> RunRecord:
        record = RunRecord(
            run_id=run_id or new_run_id(recipe.run.name),
            recipe_toml=recipe_toml,
            state=QUEUED,
            created_at=time.time(),
            tenant=tenant.name,
            extra=dict(extra or {}),
        )
        if shared:
            # Its deployments are the router's configured ones, already placed: Ray counts them in use.
            record.extra[STATIC_DEPLOYMENTS_KEY] = True
            demand = demand.without_deployments()
        self._demands[record.run_id] = demand
        starts = {
            w.record.run_id
            for w, reason in await self._plan([*await self.store.list(), record], caller=tenant)
            if not reason
        }
        if record.run_id in starts:
            record.state = "pending"
        # The run's trace is the one CreateRun is in: its episodes, steps and lifecycle link to it.
        carrier = telemetry.current_carrier()
        if carrier:
            record.extra[RUN_TRACE_KEY] = carrier
        try:
            await self.store.create(record)
        except Exception as exc:
            self._demands.pop(record.run_id, None)
            other = await self.store.get(record.run_id)
            if other is not None:
                if not tenant.sees(other.tenant):
                    # Said without telling whose: the id is taken, the run stays invisible.
                    raise AlreadyExists(f"run_id: {record.run_id!r} is taken; choose another") from exc
                raise AlreadyExists(f"run_id: run {record.run_id!r} already exists") from exc
            raise
        if record.state == "pending":
            self._drive(record.run_id)
        else:
            log.info("run %s queued", record.run_id)
        for other in starts - {record.run_id}:
            await self._start_queued(other)
        return record

    async def get(self, run_id: str, tenant: Tenant) -> RunRecord:
        """The run, if `tenant` may see it: another tenant's run is NotFound, as if it did not exist."""
        if not run_id:
            raise InvalidArgument("run_id: must not be empty")
        try:
            subjects.validate_run_id(run_id)
        except ValueError as exc:
            raise InvalidArgument(f"run_id: {exc}") from exc
        record = await self.store.get(run_id)
        if record is None or not tenant.sees(record.tenant):
            raise NotFound(f"run_id: no run {run_id!r}")
        return record

    async def stop(self, run_id: str, tenant: Tenant) -> RunRecord:
        record = await self.get(run_id, tenant)
        if record.state in FINAL:
            raise FailedPrecondition(f"run_id: run {run_id!r} already {record.state}")
        # Stopped first: the trainer and packer follow the record, and StopRun answers even when
        # the run's driver is stuck in a call; the driver then ends at its next look at the record.
        # A queued run has no driver: it just leaves the queue.
        stopped = await self.store.update(run_id, lambda r: setattr(r, "state", "stopped"))
        driver = self.drivers.pop(run_id, None)
        if driver is not None:
            try:
                await asyncio.wait_for(driver.stop(), timeout=STOP_DRIVER_S)
            except TimeoutError:
                log.warning("run %s: its driver did not end within %.0fs of the stop", run_id, STOP_DRIVER_S)
        await self._admit_logged()
        return stopped

    async def close(self) -> None:
        for task in list(self._admitting):
            task.cancel()
        for driver in list(self.drivers.values()):
            driver.on_end = None
            await driver.stop()


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, runs: RunManager, auth: TokenAuth) -> None:
        self.runs, self.auth = runs, auth

    async def CreateRun(self, request, context):
        tenant = self.auth.check_grpc(context)
        record = await self.runs.create(request.recipe_toml, request.run_id, tenant)
        return gateway_pb2.CreateRunResponse(run=await self.runs.proto(record))

    async def GetRun(self, request, context):
        tenant = self.auth.check_grpc(context)
        record = await self.runs.get(request.run_id, tenant)
        return gateway_pb2.GetRunResponse(run=await self.runs.proto(record))

    async def ListRuns(self, request, context):
        tenant = self.auth.check_grpc(context)
        queue = await self.runs.queue()
        return gateway_pb2.ListRunsResponse(
            runs=[await self.runs.proto(r, queue) for r in await self.runs.list(tenant)]
        )

    async def StopRun(self, request, context):
        tenant = self.auth.check_grpc(context)
        record = await self.runs.stop(request.run_id, tenant)
        return gateway_pb2.StopRunResponse(run=await self.runs.proto(record))

    async def WatchRun(self, request, context) -> AsyncIterator[gateway_pb2.WatchRunResponse]:
        tenant = self.auth.check_grpc(context)
        async for run in self.runs.watch(request.run_id, tenant):
            yield gateway_pb2.WatchRunResponse(run=run)
