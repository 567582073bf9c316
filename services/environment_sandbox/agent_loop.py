"""The agent loop: run episodes (model <-> environment), score them, publish rollouts.

`EpisodeRunner.run(task)` plays one episode: it renders the environment's opening messages with
the chat template, asks the inference-router for the model's turn (one session id per episode so
a multi-turn episode stays on the replica holding its cache), feeds the decoded reply to the
environment, appends the environment's answer (rendered with the same template) and repeats
until done. Every model turn keeps its sampled tokens, their log-probs and the weight version it
was sampled under (trainable); prompt and environment tokens are kept masked out. The reward
service then scores the episode.

`EpisodeWorker` pulls EpisodeTasks from the JetStream work queue, runs up to `concurrency`
episodes at once, publishes each rollout with msg_id = rollout_id (deterministic from run, task
and sample index, so a redelivered task re-publishes the same id and the stream drops the
duplicate) and only then acks the task. A crash between publish and ack therefore costs a
duplicate publish that the stream deduplicates, never a lost or doubled rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.environments import (
    EnvContext,
    EnvironmentError_,
    make_environment,
    parse_task,
)
from services.environment_sandbox.environments.datasets import is_index_task, task_by_index
from services.environment_sandbox.ratelimit import Limit, RateLimiter

log = logging.getLogger(__name__)
# The resource the agent loop reserves before every model turn when a limit names it.
INFERENCE_RESOURCE = "inference"
_ROLLOUT_NS = uuid.UUID("5b3f1c4e-0d5a-4d0b-9a57-3f1f6f0e2a11")


def rollout_id_for(run_id: str, task_id: str, group_id: str, sample_index: int) -> str:
    """Same episode sample -> same id, on every worker and every redelivery."""
    return uuid.uuid5(_ROLLOUT_NS, f"{run_id}/{group_id}/{task_id}/{sample_index}").hex


@dataclass
class ModelTurn:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class Generator(Protocol):
    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
    ) -> ModelTurn: ...


@dataclass
class Score:
    score: float
    components: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    reasons: dict[str, str] = field(default_factory=dict)


# (reward name, task json, completion, rollout id, transcript, environment reward) -> Score
Scorer = Callable[[str, str, str, str, str, float | None], Awaitable[Score]]


@dataclass
class LoopConfig:
    default_max_tokens: int = 32
    max_episode_tokens: int = 2048


class EpisodeRunner:
    def __init__(
        self,
        generate: Generator,
        score: Scorer | None,
        tokenizer: Any,
        env_context: EnvContext | None = None,
        config: LoopConfig | None = None,
        limiter: RateLimiter | None = None,
        rate_limits: dict[str, Limit] | None = None,
    ) -> None:
        self.generate = generate
        self.score = score
        self.tokenizer = tokenizer
        self.env_context = env_context or EnvContext()
        self.config = config or LoopConfig()
        # Without a shared (Ray) limiter the limits still hold within this process.
        self.limiter = limiter or RateLimiter.local()
        self.rate_limits = dict(rate_limits or {})  # the service's: they win over an environment's

    async def _limits_for(self, env: Any) -> dict[str, Limit]:
        limits = {**getattr(env.config, "rate_limits", {}), **self.rate_limits}
        if limits:
            await self.limiter.ensure(limits)
        env.context = self.env_context.with_limits(limits)
        return limits

    async def _reserve_inference(self, limits: dict[str, Limit], prompt_tokens: int, n: int, max_tokens: int):
        """Count a Generate call as one request (per completion) and prompt + max_tokens tokens:
        the most the call can use, as API quotas count it, so the limit holds before the
        answer's real length is known."""
        if INFERENCE_RESOURCE in limits:
            await self.limiter.acquire(INFERENCE_RESOURCE, float(n), float(prompt_tokens + n * max_tokens))

    def _render(self, messages: list[dict[str, str]], after_model: bool) -> list[int]:
        from services.modeling.tokenizer import render_chatml

        text = render_chatml(messages, add_generation_prompt=True)
        # The model's turn ended with <|im_end|>; ChatML puts a newline after it.
        return self.tokenizer.encode(("\n" if after_model else "") + text)

    async def run(self, task: events_pb2.EpisodeTask) -> common_pb2.Rollout:
        env = make_environment(task.environment, task.environment_config_json or None, self.env_context)
        payload = parse_task(task.task_json)
        if is_index_task(payload):
            payload = task_by_index(
                task.environment,
                payload["index"],
                payload.get("seed", 0),
                task.environment_config_json or None,
            )
        task_json = json.dumps(payload)
        rollout_id = rollout_id_for(task.run_id, task.task_id, task.group_id, task.sample_index)
        session_id = f"{task.run_id}/{rollout_id}"
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(task.sampling)
        if sampling.max_tokens <= 0:
            sampling.max_tokens = self.config.default_max_tokens
        eos = self.tokenizer.eos_token_id
        if eos not in sampling.stop_token_ids:
            sampling.stop_token_ids.append(eos)
        sampling.n = 1
        base_seed = sampling.seed

        rollout = common_pb2.Rollout(
            rollout_id=rollout_id,
            run_id=task.run_id,
            group_id=task.group_id,
            task_id=task.task_id,
            environment=task.environment,
            group_size=task.group_size,
            sample_index=task.sample_index,
        )
        limits = await self._limits_for(env)
        env_started = time.perf_counter()
        observation = await env.reset(payload)
        env_seconds = time.perf_counter() - env_started
        gen_seconds = 0.0
        prompt_ids = self._render(observation, after_model=False)
        rollout.turns.append(
            common_pb2.Turn(
                role=common_pb2.ROLE_USER,
                token_ids=prompt_ids,
                trainable=False,
                text=self.tokenizer.decode(prompt_ids),
            )
        )
        context = list(prompt_ids)
        env_reward = 0.0
        versions: list[int] = []
        last_action, finish = "", "stop"
        turn = 0
        while True:
            if base_seed:
                sampling.seed = base_seed + 7919 * task.sample_index + turn
            await self._reserve_inference(limits, len(context), 1, sampling.max_tokens)
            started = time.perf_counter()
            model = await self.generate(context, sampling, session_id, task.min_weight_version)
            gen_seconds += time.perf_counter() - started
            versions.append(model.weight_version)
            last_action = self.tokenizer.decode(model.token_ids, skip_special_tokens=True)
            rollout.turns.append(
                common_pb2.Turn(
                    role=common_pb2.ROLE_ASSISTANT,
                    token_ids=model.token_ids,
                    logprobs=model.logprobs,
                    trainable=True,
                    weight_version=model.weight_version,
                    text=self.tokenizer.decode(model.token_ids),
                )
            )
            context.extend(model.token_ids)
            finish = model.finish_reason
            started = time.perf_counter()
            try:
                step = await env.step(last_action)
            except EnvironmentError_ as exc:  # e.g. action too long: the episode ends, unrewarded
                finish = f"env_error: {exc}"
                break
            finally:
                env_seconds += time.perf_counter() - started
            env_reward += step.reward
            turn += 1
            if step.done:
                finish = step.info.get("finish", finish)
                break
            env_ids = self._render(step.observation, after_model=True)
            if model.token_ids and model.token_ids[-1] != eos:
                env_ids = [eos, *env_ids]  # close the cut-off turn so the template stays well formed
            rollout.turns.append(
                common_pb2.Turn(
                    role=common_pb2.ROLE_ENVIRONMENT,
                    token_ids=env_ids,
                    trainable=False,
                    text=self.tokenizer.decode(env_ids),
                )
            )
            context.extend(env_ids)
            if len(context) + sampling.max_tokens > self.config.max_episode_tokens:
                finish = "max_episode_tokens"
                break
        rollout.min_weight_version = min(versions)
        rollout.max_weight_version = max(versions)
        rollout.generation_seconds = gen_seconds
        rollout.environment_seconds = env_seconds
        rollout.finish_reason = finish
        reward_name = task.reward or env.default_reward
        if self.score is not None and reward_name:
            transcript = "".join(t.text for t in rollout.turns)
            score = await self.score(reward_name, task_json, last_action, rollout_id, transcript, env_reward)
            rollout.reward = score.score
            rollout.reward_components.update(score.components)
            if not score.ok:
                log.warning("rollout %s scored with failed components: %s", rollout_id, score.reasons)
        else:
            rollout.reward = env_reward
            rollout.reward_components["environment"] = env_reward
        return rollout


# -- gRPC adapters (the service wires these; tests may pass their own callables) -------------------


class RouterGenerator:
    """Generator over InferenceRouterService.Generate."""

    def __init__(self, channel: Any, timeout_s: float = 120.0) -> None:
        from looprl.inference.v1 import inference_pb2_grpc

        self.stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        self.timeout_s = timeout_s

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version) -> ModelTurn:
        from looprl.inference.v1 import inference_pb2

        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            session_id=session_id,
            min_weight_version=min_weight_version,
            request_id=uuid.uuid4().hex,
        )
        response = await self.stub.Generate(request, timeout=self.timeout_s)
        c = response.completions[0]
        return ModelTurn(list(c.token_ids), list(c.logprobs), c.finish_reason, c.weight_version)


class RewardClient:
    """Scorer over RewardService.Score."""

    def __init__(self, channel: Any, timeout_s: float = 60.0) -> None:
        from looprl.reward.v1 import reward_pb2_grpc

        self.stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.timeout_s = timeout_s

    async def __call__(self, reward, task_json, completion, rollout_id, transcript, env_reward) -> Score:
        from looprl.reward.v1 import reward_pb2

        request = reward_pb2.ScoreRequest(
            reward=reward,
            task_json=task_json,
            completion=completion,
            rollout_id=rollout_id,
            transcript=transcript,
        )
        if env_reward is not None:
            request.environment_reward = env_reward
        response = await self.stub.Score(request, timeout=self.timeout_s)
        return Score(
            response.score,
            {c.name: c.score for c in response.components if c.ok},
            response.ok,
            {c.name: c.reason for c in response.components if not c.ok},
        )


# -- the work-queue consumer ---------------------------------------------------------------------


@dataclass
class WorkerConfig:
    concurrency: int = 16
    durable: str = "environment-sandbox"
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    retry_delay_s: float = 1.0


class EpisodeWorker:
    def __init__(
        self,
        bus: Any,
        runner: EpisodeRunner,
        config: WorkerConfig | None = None,
        filter_subject: str | None = None,
    ) -> None:
        from services.kit import subjects

        self.bus = bus
        self.runner = runner
        self.config = config or WorkerConfig()
        self.filter_subject = filter_subject or subjects.all_runs(subjects.Kind.EPISODES)
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self.published = 0
        self.failed = 0
        # Test hook for the crash test: die right after publishing, before acking.
        self._crash_after_publish = os.environ.get("LOOPRL_TEST_CRASH_AFTER_PUBLISH") == "1"

    async def run(self) -> None:
        from services.kit import subjects

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
        from services.kit import subjects
        from services.kit.bus import PoisonMessage

        heartbeat = asyncio.ensure_future(self._heartbeat(delivery))
        try:
            try:
                task = delivery.parse(events_pb2.EpisodeTask)
                with delivery.process_span():
                    rollout = await self.runner.run(task)
            except (PoisonMessage, EnvironmentError_, json.JSONDecodeError) as exc:
                await delivery.term(f"bad episode task: {exc}")
                self.failed += 1
                return
            except Exception:
                log.exception("episode failed; handing the task back")
                await delivery.nak(delay=self.config.retry_delay_s)
                self.failed += 1
                return
            await self.bus.publish(subjects.rollouts(task.run_id), rollout, msg_id=rollout.rollout_id)
            self.published += 1
            if self._crash_after_publish:
                os._exit(17)
            await delivery.ack()
        finally:
            heartbeat.cancel()

    async def _heartbeat(self, delivery: Any) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.config.ack_wait_s / 3))
            with contextlib.suppress(Exception):
                await delivery.in_progress()
