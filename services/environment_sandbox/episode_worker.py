"""The episode work-queue consumer: pulls EpisodeTasks from a run's EPISODES work queue, runs them
through the EpisodeRunner (bounded concurrency), publishes the task's rollouts as one RolloutGroup
message (kit/messages/rollouts.py; its id follows from the rollout ids, so a redelivered task is
deduplicated) and only then acks the task; in_progress heartbeats keep long
episodes from being redelivered, and bad tasks are terminated with their reason.

Each task is its own trace: an "episode" root span, linked to the gateway's publish of the task,
covers the agent loop (every Generate and reward call) and the publish of the task's rollouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner
from services.environment_sandbox.clients import CURRENT_RUN
from services.environment_sandbox.config import WorkerConfig
from services.environment_sandbox.environments import EnvironmentError_, PluginFailure
from services.kit.messages.run_errors import describe

if TYPE_CHECKING:
    from services.kit.bus.client import Bus

log = logging.getLogger("looprl.environment_sandbox.worker")


class EpisodeWorker:
    def __init__(
        self,
        bus: Bus,
        runner: EpisodeRunner,
        config: WorkerConfig | None = None,
        filter_subject: str | None = None,
        reporter: Any = None,
    ) -> None:
        from services.kit.bus import subjects

        self.bus = bus
        self.runner = runner
        self.config = config or WorkerConfig()
        self.filter_subject = filter_subject or subjects.all_runs(subjects.Kind.EPISODES)
        # A RunErrorReporter: failed episodes are reported to their run, not only logged.
        self.reporter = reporter
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self.published = 0
        self.failed = 0
        # Test hook for the crash test: die right after publishing, before acking.
        self._crash_after_publish = os.environ.get("LOOPRL_TEST_CRASH_AFTER_PUBLISH") == "1"

    async def run(self) -> None:
        from services.kit.bus import subjects

        consumer = await self.bus.pull_consumer(
            subjects.EPISODES,
            self.config.durable,
            self.filter_subject,
            ack_wait=self.config.ack_wait_s,
            max_deliver=self.config.max_deliver,
            max_ack_pending=max(1000, self.config.concurrency * 4),
        )
        try:
            while not self._stop.is_set():
                free = self.config.concurrency - len(self._tasks)
                if free <= 0:
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    deliveries = await consumer.fetch(batch=free, timeout=0.5)
                except Exception:  # nothing pending (timeout) or a bus hiccup: try again
                    deliveries = []
                for delivery in deliveries:
                    task = asyncio.ensure_future(self._handle(delivery))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            with contextlib.suppress(Exception):
                await consumer.close()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop fetching; let running episodes finish (unfinished ones are redelivered)."""
        self._stop.set()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)

    async def _handle(self, delivery: Any) -> None:

        heartbeat = asyncio.ensure_future(self._heartbeat(delivery))
        try:
            with delivery.process_span("episode", new_trace=True) as span:
                await self._episode(delivery, span)
        finally:
            heartbeat.cancel()

    async def _episode(self, delivery: Any, span: Any) -> None:
        from services.kit.bus import subjects
        from services.kit.bus.client import PoisonMessage
        from services.kit.messages import rollouts as rollout_messages
        from services.kit.telemetry import tracing as telemetry

        try:
            task = delivery.parse(events_pb2.EpisodeTask)
            if span.is_recording():
                span.set_attributes(
                    {
                        telemetry.ATTR.RUN_ID: task.run_id,
                        telemetry.ATTR.TASK_ID: task.task_id,
                        telemetry.ATTR.STEP: task.step,
                        "looprl.environment": task.environment,
                    }
                )
            CURRENT_RUN.set(task.run_id)  # this handler's own context: one episode task
            if task.evaluation:
                raise EnvironmentError_(
                    "task.evaluation: evaluation episodes are run by RunEpisode, never trained"
                )
            rollouts = await self.runner.run_all(task)
        except PluginFailure as exc:  # the user's code is broken: the run cannot go on
            span.set_status(telemetry.error_status(exc))
            await delivery.term(f"plugin failed: {exc}")
            self.failed += 1
            await self._report(delivery, str(exc), fatal=True)
            return
        except (PoisonMessage, EnvironmentError_, json.JSONDecodeError) as exc:
            span.set_status(telemetry.error_status(exc))
            await delivery.term(f"bad episode task: {exc}")
            self.failed += 1
            await self._report(delivery, f"bad episode task, dropped: {exc}")
            return
        except Exception as exc:
            span.set_status(telemetry.error_status(exc))
            delay = self.config.retry_delay(delivery.num_delivered)
            log.exception(
                "episode failed (delivery %d); handing the task back in %.1fs",
                delivery.num_delivered,
                delay,
            )
            await delivery.nak(delay=delay)
            self.failed += 1
            await self._report(
                delivery, f"episode failed (delivery {delivery.num_delivered}, retried): {describe(exc)}"
            )
            return
        if span.is_recording():
            span.set_attributes(
                {
                    telemetry.ATTR.ROLLOUT_ID: ",".join(r.rollout_id for r in rollouts),
                    telemetry.ATTR.ROLLOUTS: len(rollouts),
                    telemetry.ATTR.TOKENS: sum(len(t.token_ids) for r in rollouts for t in r.turns),
                    telemetry.ATTR.WEIGHT_VERSION: min(r.min_weight_version for r in rollouts),
                }
            )
        # Every rollout of the task (all branches of a forked episode) before the ack: a crash
        # in between re-runs the task, re-publishing the same messages, which the stream drops.
        # The group travels as one RolloutGroup message (more only past max_payload).
        subject = subjects.rollouts(task.run_id)
        await self.bus.publish_batch(
            subject,
            rollout_messages.group_messages(rollouts, self.bus.nc.max_payload),
            rollout_messages.GROUP_HEADERS,
        )
        self.published += len(rollouts)
        if self._crash_after_publish:
            os._exit(17)
        # Unconfirmed: an ack lost to a nats-server restart re-runs the task, whose rollouts the
        # stream drops as duplicates; confirming cost a round trip per task.
        await delivery.ack(confirm=False)

    async def _report(self, delivery: Any, message: str, fatal: bool = False) -> None:
        from services.kit.bus import subjects

        if self.reporter is None:
            return
        try:
            run_id = subjects.run_of(delivery.subject)
        except ValueError:
            return
        await self.reporter.report(run_id, message, fatal=fatal)

    async def _heartbeat(self, delivery: Any) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.config.ack_wait_s / 3))
            with contextlib.suppress(Exception):
                await delivery.in_progress()
