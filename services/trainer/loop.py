"""The training loop of one run, driven from the trainer service's event loop.

Per step s: every rank pulls its micro-batches of step s from the packer and trains; every rank
pushes its shards of version s+1 to weight-sync; a TrainStepRecord goes on ``looprl.<run>.train``.
Steps are acknowledged to the packer (AckStep) once a checkpoint covers them (ack_policy
"checkpoint"), so after a crash the packer re-serves exactly the steps the restored checkpoint lacks;
that is what makes resume exact. All rank-group calls are serialized by one lock: collectives need
every rank to see the calls in the same order, and a Checkpoint RPC must fall between two steps.
They block (ray.get) in the run's own thread, so a step waiting for its batch holds neither the
event loop nor a thread another run trains with.

Each step is its own trace: a "trainer step" root span, linked to the rollouts it trains, holding
every rank's NextBatch and PushShards calls (the ranks get its context), AckStep and the
TrainStepRecord publish.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from looprl.events.v1 import events_pb2
from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import EVENT_RETRY_S, Bus
from services.kit.messages import trainer_epochs
from services.kit.messages.run_errors import RunErrorReporter, describe
from services.kit.ray import head_loss as ray_head
from services.kit.rpc import tls
from services.kit.rpc.interceptors import client_interceptors
from services.kit.telemetry import tracing as telemetry
from services.kit.telemetry.metrics import observe
from services.trainer import metrics
from services.trainer.checkpoint import export_dir, latest_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.errors import BatchRejected, PushFailed, RankLost, StepAborted
from services.trainer.ranks import RankGroup
from services.trainer.spec import TrainerSpec, spec_from_recipe

if TYPE_CHECKING:
    from services.kit.config.recipe import Recipe

# How long a step waits for its batch before the trainer pushes the version it serves again
# (`_repush_while_waiting`) without weight-sync saying it lost it; several NextBatch timeouts, so a
# slow environment does not cause it.
REPUSH_AFTER_S = 15.0

log = logging.getLogger("looprl.trainer.loop")
_tracer = trace.get_tracer("looprl.trainer.loop")


class RunTrainer:
    def __init__(self, run_id: str, recipe: Recipe, cfg: TrainerConfig, bus: Bus | None = None) -> None:
        self.run_id = subjects.validate_run_id(run_id)
        self.recipe = recipe
        self.cfg = cfg
        self.bus = bus
        # Failed steps and pushes go to the run (the gateway names them), not only to this log.
        self.reporter = RunErrorReporter(bus, "trainer") if bus is not None else None
        self.spec: TrainerSpec = spec_from_recipe(recipe, run_id)
        self.total_steps = recipe.run.steps
        self.world_size = recipe.trainer.world_size
        self.checkpoint_every = (
            cfg.checkpoint_every if cfg.checkpoint_every >= 0 else recipe.trainer.checkpoint_every
        )
        root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(cfg.state_dir) / "trainer"
        self.checkpoint_root = root / run_id
        # The steps the run evaluates are exported as they train, for `looprl eval RUN --step N`; not
        # step 0, whose weights the recipe's own model section rebuilds.
        versions = recipe.eval.versions(recipe.run.steps) if cfg.keep_eval_exports > 0 else []
        self.evaluated = frozenset(v for v in versions if v > 0)
        self._exported: set[int] = set()
        self.group = RankGroup(
            self.world_size,
            num_cpus_per_rank=recipe.trainer.num_cpus_per_rank,
            num_gpus_per_rank=recipe.trainer.num_gpus_per_rank,
            strategy=cfg.placement_strategy,
            resources_per_rank=recipe.trainer.ray_resources_per_rank,
            threads_per_rank=cfg.threads_per_rank,
            name=f"looprl-trainer-{run_id}",
        )
        self.state = "idle"
        self.step = 0
        self.last_loss = 0.0
        self.last_checkpoint = ""
        self.error = ""
        self.unacked: list[int] = []
        self._ack_lock = asyncio.Lock()
        self._acking: set[asyncio.Task] = set()  # acknowledgements running beside training
        self.recoveries = 0  # times the rank group was recreated after losing a rank
        self.epoch = ""  # this start of the ranks, vouching for the step records it publishes
        self._lock = asyncio.Lock()
        self._not_ready_since: float | None = None  # when the current step first found no batch
        self._repushed_at = 0.0
        self._stop = asyncio.Event()
        self._started = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer-{run_id}")
        metrics.init_run(self.run_id)

    # ---- rank calls, serialized ------------------------------------------------------------------

    async def _ranks(self, fn, *args: Any) -> Any:
        async with self._lock:
            call = functools.partial(contextvars.copy_context().run, fn, *args)  # as asyncio.to_thread
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    # ---- loop ------------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._prepare()
            while self.step < self.total_steps and not self._stop.is_set():
                try:
                    if self.step in self.evaluated and self.step not in self._exported:
                        await self.export()
                    if not await self._train_one():
                        continue
                    if self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0:
                        await self.checkpoint(ack_in_background=True)
                except RankLost as exc:
                    await self._recover(exc)
            finished = self.step >= self.total_steps
            await self.checkpoint(
                export_hf=finished and (self.cfg.export_hf_at_end or self.step in self.evaluated)
            )
            self.state = "completed" if finished else "stopped"
        except Exception as exc:
            await ray_head.park_if_lost(f"run {self.run_id}: training failed ({describe(exc)})", self._tell)
            self.state, self.error = "failed", str(exc)
            log.exception("run %s: training failed at step %d", self.run_id, self.step)
            await self._report(f"training failed at step {self.step}: {describe(exc)}")
        finally:
            try:
                await self._ranks(self.group.shutdown)
            finally:
                self._thread.shutdown(wait=False)

    async def _prepare(self) -> None:
        self.state = "starting"
        info = await self._ranks(self.group.start, self.spec)
        self._started = True
        log.info(
            "run %s: %d ranks up, %d parameters, on nodes %s",
            self.run_id,
            self.world_size,
            info[0]["parameters"],
            ", ".join(self.group.nodes) or "?",
        )
        latest = latest_checkpoint(self.checkpoint_root)
        if latest is not None:
            restored = await self._ranks(self.group.load_checkpoint, str(latest))
            self.step = int(restored["step"])
            self.last_checkpoint = str(latest)
            log.info("run %s: resumed from %s at step %d", self.run_id, latest, self.step)
        if self.bus is not None:  # before any step record of these ranks goes out
            kv = await self.bus.kv(subjects.TRAINER_EPOCHS)
            self.epoch = await trainer_epochs.open_epoch(kv, self.run_id, self.step)
        await self._push(self.step)
        self.state = "training"

    async def _recover(self, lost: RankLost) -> None:
        """New ranks resume from the last checkpoint; the packer re-serves the steps since, which
        were not acknowledged (ack_policy "checkpoint"), so nothing is lost or trained twice."""
        await ray_head.park_if_lost(f"run {self.run_id}: rank lost ({lost})", self._tell)
        self.recoveries += 1
        if self.checkpoint_every <= 0 or self.cfg.ack_policy != "checkpoint":
            raise RuntimeError(
                f"a trainer rank was lost ({lost}) and the run cannot resume: it keeps no "
                "checkpoints acknowledged with its steps (checkpoint_every, ack_policy)"
            )
        if self.recoveries > self.cfg.rank_recoveries:
            raise RuntimeError(
                f"trainer ranks lost {self.recoveries} times (trainer rank_recoveries = "
                f"{self.cfg.rank_recoveries}): {lost}"
            )
        log.warning("run %s: rank lost at step %d (%s); recreating the ranks", self.run_id, self.step, lost)
        if self.reporter is not None:
            await self.reporter.report(
                self.run_id,
                f"trainer rank lost at step {self.step} ({lost}); resuming from the last checkpoint",
            )
        await self._ranks(self.group.shutdown)
        self.step, self.unacked = 0, []
        try:
            await self._prepare()
        except Exception as exc:
            raise RuntimeError(
                f"recreating the ranks after a lost rank ({lost}) failed: {describe(exc)}"
            ) from exc

    async def _train_one(self) -> bool:
        with _tracer.start_as_current_span(
            "trainer step",
            context=telemetry.new_trace(),
            attributes={telemetry.ATTR.RUN_ID: self.run_id, telemetry.ATTR.STEP: self.step},
        ) as span:
            return await self._train_one_traced(span)

    async def _train_one_traced(self, span: trace.Span) -> bool:
        step = self.step
        started = time.perf_counter()
        try:
            result = await self._ranks(
                self.group.pull_and_train,
                self.cfg.packer_address,
                self.run_id,
                step,
                self.cfg.next_batch_timeout_s,
                self.cfg.weight_sync_address,  # the ranks push the new version right after the step
                telemetry.current_carrier() or None,
            )
        except StepAborted as exc:
            span.set_status(telemetry.error_status(exc))
            log.info("run %s: step %d not ready (%s); retrying", self.run_id, step, exc)
            await self._repush_while_waiting()
            await asyncio.sleep(0.2)
            return False
        except BatchRejected as exc:
            raise RuntimeError(f"the packer served an invalid batch for step {step}: {exc}") from exc
        self._not_ready_since = None
        if span.is_recording():
            links, dropped = telemetry.link_carriers(
                [{"traceparent": t} for t in result.get("rollout_traceparents", [])],
                limit=self.recipe.batch.rollouts_per_step,
            )
            for link in links:
                span.add_link(link.context)
            span.set_attributes(
                {
                    telemetry.ATTR.WEIGHT_VERSION: result["version"],
                    telemetry.ATTR.TOKENS: int(result["num_tokens"]),
                    telemetry.ATTR.STALENESS: result["max_staleness"],
                    telemetry.ATTR.ROLLOUTS: int(result["sequences"]),
                    telemetry.ATTR.LINKS_DROPPED: dropped,
                }
            )
        self.step = step + 1
        self.last_loss = result["loss"]
        metrics.record_step(self.run_id, result, time.perf_counter() - started)
        self.unacked.append(step)
        await self._push(self.step, result.get("pushes", []))
        if self.cfg.ack_policy == "step" or self.checkpoint_every <= 0:
            await self._ack_pending()
        await self._publish(result)
        log.info(
            "run %s: step %d loss %.4f grad_norm %.3f tokens/s %.0f",
            self.run_id,
            step,
            result["loss"],
            result["grad_norm"],
            result["tokens_per_second"],
        )
        return True

    async def _repush_while_waiting(self) -> None:
        """Push the served version again when weight-sync says it lost it (asked each time a step's
        batch wait times out), or once a step has waited REPUSH_AFTER_S for its batch regardless.

        A weight-sync killed after a version completed but before its deployments received it
        restarts knowing the version's number but not its bytes, and nothing else would send them:
        the deployments keep serving the version before, and a synchronous run waits forever for
        rollouts of the new one. Weight-sync refuses the push when it still holds the version."""
        now = time.monotonic()
        if self._not_ready_since is None:
            self._not_ready_since = now
        waited = now - max(self._not_ready_since, self._repushed_at)
        if not self.cfg.weight_sync_address:
            return
        if waited < REPUSH_AFTER_S and not await self._weight_sync_lost_served_version():
            return
        self._repushed_at = now
        try:
            results = await self._ranks(self.group.push_weights, self.cfg.weight_sync_address, self.step)
        except PushFailed as exc:
            log.info("run %s: pushing version %d again failed: %s", self.run_id, self.step, exc)
            return
        if not any(r.get("skipped") or r.get("error") for r in results):
            log.warning("run %s: weight-sync had lost version %d; pushed it again", self.run_id, self.step)

    async def _weight_sync_lost_served_version(self) -> bool:
        """Whether weight-sync says it lacks the bytes of the version this trainer serves, which a
        target behind it or one registering later would need (False when it cannot be asked: the
        timed re-push remains)."""
        request = weightsync_pb2.GetVersionRequest(run_id=self.run_id)
        try:
            async with tls.aio_channel(
                self.cfg.weight_sync_address, interceptors=client_interceptors()
            ) as ch:
                reply = await weightsync_pb2_grpc.WeightSyncServiceStub(ch).GetVersion(request, timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.info("run %s: weight-sync's versions unavailable: %s", self.run_id, exc.details())
            return False
        return reply.latest_version == self.step and not reply.latest_bytes_held

    async def _push(self, version: int, results: list[dict[str, Any]] | None = None) -> None:
        """Have every rank push `version` to weight-sync (results: a push already made with the step).

        While weight-sync is unreachable (a restart, a network blip) the push is retried from every
        rank, 0.5 s doubling to 10 s apart, for up to `push_retry_s`; ranks whose shards already
        arrived are then refused as "already finished", which is success. The first failure and
        the give-up are reported to the run.
        """
        if not self.cfg.weight_sync_address:
            return
        delay, deadline, attempt = 0.5, time.monotonic() + self.cfg.push_retry_s, 0
        while True:
            if results is None:
                try:
                    results = await self._ranks(
                        self.group.push_weights, self.cfg.weight_sync_address, version
                    )
                except PushFailed as exc:
                    results = [{"error": str(exc)}]
            errors = [r["error"] for r in results if r.get("error")]
            if not errors:
                break
            attempt += 1
            if time.monotonic() + delay > deadline:
                raise RuntimeError(
                    f"pushing version {version} to weight-sync failed {attempt} times over "
                    f"{self.cfg.push_retry_s:g}s (trainer push_retry_s): {errors[0]}"
                )
            log.warning(
                "run %s: push of version %d failed (%s); retry %d in %.1fs",
                self.run_id,
                version,
                errors[0],
                attempt,
                delay,
            )
            if attempt == 1 and self.reporter is not None:
                await self.reporter.report(
                    self.run_id, f"pushing version {version} failed, retrying: {errors[0]}"
                )
            if await self._stopped_within(delay):
                return
            delay, results = min(2 * delay, 10.0), None
        skipped = [r["skipped"] for r in results if r.get("skipped")]
        if skipped and attempt == 0:  # after a retry, refusals are the earlier attempts' shards
            log.warning("run %s: weight-sync refused version %d: %s", self.run_id, version, skipped[0])
            if self.reporter is not None:
                await self.reporter.report(
                    self.run_id, f"weight-sync refused version {version}: {skipped[0]}"
                )
        elif attempt:
            log.info("run %s: version %d pushed after %d retries", self.run_id, version, attempt)

    async def _stopped_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _tell(self, message: str) -> None:
        """What the run should know while it goes on (not fatal)."""
        if self.reporter is not None:
            await self.reporter.report(self.run_id, f"trainer at step {self.step}: {message}")

    async def _report(self, message: str) -> None:
        """The run cannot go on here: tell the gateway, which fails it with this message."""
        if self.reporter is not None:
            await self.reporter.report(self.run_id, message, fatal=True)
            await self.reporter.close()

    async def _ack_pending(self, below: int | None = None) -> None:
        """Acknowledge the unacked steps (those below `below` only), oldest first; one caller at a time."""
        async with self._ack_lock:
            await self._ack_steps(below)

    def _ack_in_background(self, below: int) -> None:
        """Acknowledge the steps below `below` while training goes on: a checkpoint's ~50 AckSteps
        (each a packer KV write) would otherwise stall the loop for a few hundred ms. Steps trained
        meanwhile stay unacked until a checkpoint covers them; a later `_ack_pending` waits for this."""
        task = asyncio.create_task(self._ack_pending(below), name=f"ack-{self.run_id}-{below}")
        self._acking.add(task)
        task.add_done_callback(self._acking.discard)

    async def _ack_steps(self, below: int | None) -> None:
        if not self.unacked:
            return
        async with tls.aio_channel(self.cfg.packer_address, interceptors=client_interceptors()) as channel:
            stub = packer_pb2_grpc.RolloutPackerServiceStub(channel)
            while self.unacked and (below is None or self.unacked[0] < below):
                step = self.unacked[0]
                try:
                    await stub.AckStep(
                        packer_pb2.AckStepRequest(run_id=self.run_id, step=step, trainer_version=step + 1),
                        timeout=30,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already acked is fine
                        log.warning("run %s: AckStep(%d) failed: %s", self.run_id, step, exc.details())
                        return
                if self.unacked and self.unacked[0] == step:  # a recovery may have reset the list meanwhile
                    self.unacked.pop(0)

    async def _publish(self, m: dict[str, Any]) -> None:
        if self.bus is None:
            return
        record = events_pb2.TrainStepRecord(
            run_id=self.run_id,
            step=m["step"],
            version=m["version"],
            loss=m["loss"],
            clip_fraction=m["clip_fraction"],
            kl=m["kl"],
            entropy=m["entropy"],
            grad_norm=m["grad_norm"],
            tokens_per_second=m["tokens_per_second"],
            mean_staleness=m["staleness"],
            max_staleness=m["max_staleness"],
            num_rollouts=int(m["sequences"]),
            num_tokens=int(m["num_tokens"]),
            response_tokens=int(m.get("loss_tokens", 0)),
            step_seconds=m["step_seconds"],
            rollout_ids=m["rollout_ids"],
            reward_mean=m.get("reward_mean", 0.0),
            reward_std=m.get("reward_std", 0.0),
            trainer_epoch=self.epoch,
            importance_ratio_mean=m.get("ratio", 0.0),
            importance_ratio_max=m.get("ratio_max", 0.0),
            importance_ratio_min=m.get("ratio_min", 0.0),
            importance_ratio_clipped=m.get("ratio_clipped", 0.0),
        )
        try:
            # Retried through a nats-server restart: nothing publishes a lost record again, and the
            # run's history and rollout accounting would stay a step short for good.
            await self.bus.publish_retrying(
                subjects.train(self.run_id),
                record,
                # Per epoch: a step retrained after a resume is a record of its own, not a duplicate.
                msg_id=f"{self.run_id}-train-{m['step']}-{self.epoch}",
                within_s=EVENT_RETRY_S,
            )
        except Exception as exc:  # progress events must not stop training
            log.error("run %s: the record of step %d is lost: %s", self.run_id, m["step"], describe(exc))

    # ---- control ---------------------------------------------------------------------------------

    async def checkpoint(
        self, export_hf: bool = False, ack_in_background: bool = False
    ) -> tuple[str, int, str]:
        """Checkpoint now (between steps), then acknowledge the steps it covers (with
        ack_in_background, while the next steps train)."""
        if not self._started:
            raise RuntimeError("the rank group is not running")
        start = time.perf_counter()
        path = await self._ranks(
            self.group.save_checkpoint,
            str(self.checkpoint_root),
            {"run_id": self.run_id},
            self.cfg.keep_checkpoints,
        )
        self.last_checkpoint = path
        observe(metrics.CHECKPOINT_SECONDS.labels(self.run_id, "checkpoint"), time.perf_counter() - start)
        if ack_in_background:
            self._ack_in_background(self.step)
        else:
            await self._ack_pending()
        hf_path = await self.export() if export_hf else ""
        log.info("run %s: checkpoint %s in %.1fs", self.run_id, path, time.perf_counter() - start)
        return path, self.step, hf_path

    async def export(self) -> str:
        """A Hugging Face export of the current step's weights; the exports of evaluated steps are
        pruned to the newest keep_eval_exports."""
        step = self.step
        hf_path = str(export_dir(self.checkpoint_root, step))
        exporting = time.perf_counter()
        await self._ranks(self.group.export_hf, hf_path, sorted(self.evaluated), self.cfg.keep_eval_exports)
        self._exported.add(step)
        observe(metrics.CHECKPOINT_SECONDS.labels(self.run_id, "hf_export"), time.perf_counter() - exporting)
        return hf_path

    def request_stop(self) -> None:
        """Stop after the current step: final checkpoint, then the ranks are freed."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()
