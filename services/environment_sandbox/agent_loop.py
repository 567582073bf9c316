"""The agent loop: run episodes (model <-> environment), score them, publish rollouts.

`EpisodeRunner.run(task)` plays one episode with the run's tokenizer (`EpisodeTask.tokenizer`, the
recipe's `model.tokenizer`; loaded once per tokenizer and cached): it renders the environment's
opening messages (and its tools, if it has any) with that tokenizer's chat template, asks the
inference-router for the model's turn (one session id per episode so a multi-turn episode stays on
the replica holding its cache), feeds the decoded reply to the environment and extends the token
ids with the template's continuation for the environment's answer (`chat_continuation`: the ids
already sent are never re-rendered, so the prefix the replica caches stays valid), and repeats
until done. Every model turn keeps its sampled tokens, their log-probs and the weight version it
was sampled under (trainable); prompt and environment tokens are kept masked out. The reward
service then scores the episode, unless the environment scores it itself (repo: its hidden tests).
Whatever a task's environments hold (a repository workspace) is released when the task ends,
however it ends.

`EpisodeWorker` pulls EpisodeTasks from the JetStream work queue, runs up to `concurrency`
episodes at once, publishes the task's rollouts as one RolloutGroup message whose id follows from
their rollout ids (deterministic from run, task and sample index, so a redelivered task
re-publishes the same message and the stream drops the duplicate) and only then acks the task.

Episodes fork (EpisodeTask.branches / branch_at_turn): the episode is played once up to a model
turn, then continued n times from that shared prefix (environment state copied with
`Environment.afork`: a repository workspace forks copy-on-write), sampled as one n-completion request on the episode's session so the shared
tokens are prefilled once on one replica. Each branch is its own rollout; all are published
before the task is acked. A crash between publish and ack therefore costs a
duplicate publish that the stream deduplicates, never a lost or doubled rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.decisions.length_prediction import LengthKey, LengthPredictor, prompt_digest
from services.environment_sandbox.clients import RewardClient, RouterGenerator  # noqa: F401 - re-exported
from services.environment_sandbox.config import LoopConfig
from services.environment_sandbox.environments import (
    EnvContext,
    Environment,
    EnvironmentError_,
    PluginFailure,
    make_environment,
    parse_task,
    plugin_code,
)
from services.environment_sandbox.environments.datasets import is_index_task, task_by_index
from services.environment_sandbox.model_io import (  # noqa: F401 - re-exported: callers build these from agent_loop
    Generator,
    ModelTurn,
    OneAtATime,
    Score,
    Scorer,
)
from services.environment_sandbox.ratelimit import Limit, RateLimiter
from services.environment_sandbox.run_dataset import DatasetCache
from services.modeling.tokenizer import Tokenizer, TokenizerCache

log = logging.getLogger(__name__)
# The resource the agent loop reserves before every model turn when a limit names it.
INFERENCE_RESOURCE = "inference"
_ROLLOUT_NS = uuid.UUID("5b3f1c4e-0d5a-4d0b-9a57-3f1f6f0e2a11")


MAX_BRANCHES = 256


def task_source(environment: str, task: dict[str, Any]) -> str:
    """Where a task comes from, for per-source length predictions when the run's dataset section
    does not say: the task's "source" (or verl's "data_source") field when it names one (an
    environment's own dataset file, such as math's), else its environment."""
    for name in ("source", "data_source"):
        value = task.get(name)
        if isinstance(value, str) and value:
            return value[:128]
    return environment


def rollout_id_for(
    run_id: str, task_id: str, group_id: str, sample_index: int, branch: int | None = None
) -> str:
    """Same episode sample (and branch of a forked episode) -> same id, on every worker and
    every redelivery."""
    key = f"{run_id}/{group_id}/{task_id}/{sample_index}" + ("" if branch is None else f"/b{branch}")
    return uuid.uuid5(_ROLLOUT_NS, key).hex


@dataclass
class _Episode:
    """One episode in progress; `fork` gives an independent copy at the same point."""

    env: Environment
    rollout: common_pb2.Rollout
    context: list[int]
    limits: dict[str, Limit]
    tokenizer: Tokenizer
    # The conversation so far as chat messages (the model's turns as their decoded text): what the
    # chat template continues from when the environment answers.
    messages: list[dict[str, str]]
    # The task's source (its dataset's "source"/"data_source" field, else the environment): output
    # lengths are predicted per source.
    source: str = ""
    env_reward: float = 0.0
    versions: list[int] = field(default_factory=list)
    last_action: str = ""
    finish: str = "stop"
    turn: int = 0  # model turns played
    done: bool = False
    gen_seconds: float = 0.0
    env_seconds: float = 0.0

    async def fork(self) -> _Episode:
        rollout = common_pb2.Rollout()
        rollout.CopyFrom(self.rollout)
        return dataclasses.replace(
            self,
            env=await self.env.afork(),
            rollout=rollout,
            context=list(self.context),
            messages=list(self.messages),
            versions=list(self.versions),
        )


def _reply_text(tokenizer: Tokenizer, ids: list[int], keep_special: bool) -> str:
    """The model's reply as the environment reads it. With tools, special tokens stay (a template
    may mark <tool_call> special, as vLLM's hermes parser knows) and only the closing eos goes."""
    if not keep_special:
        return tokenizer.decode(ids, skip_special_tokens=True)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids)


class EpisodeRunner:
    def __init__(
        self,
        generate: Generator,
        score: Scorer | None,
        tokenizer: Tokenizer | TokenizerCache,
        env_context: EnvContext | None = None,
        config: LoopConfig | None = None,
        limiter: RateLimiter | None = None,
        rate_limits: dict[str, Limit] | None = None,
        datasets: DatasetCache | None = None,
    ) -> None:
        self.generate = generate
        self.datasets = datasets or DatasetCache()
        self.score = score
        # A task naming no tokenizer gets the cache's default (a plain tokenizer given here is it).
        self.tokenizers = tokenizer if isinstance(tokenizer, TokenizerCache) else TokenizerCache(tokenizer)
        self.env_context = env_context or EnvContext()
        self.config = config or LoopConfig()
        # Without a shared (Ray) limiter the limits still hold within this process.
        self.limiter = limiter or RateLimiter.local()
        self.rate_limits = dict(rate_limits or {})  # the service's: they win over an environment's
        # Each model turn's expected output length, sent with its request (the router
        # routes on it): learned from the completions this process has seen.
        self.lengths = LengthPredictor() if self.config.predict_output_lengths else None

    async def _limits_for(self, env: Any) -> dict[str, Limit]:
        limits = {**env.config.rate_limits, **self.rate_limits}
        if limits:
            await self.limiter.ensure(limits)
        env.context = self.env_context.with_limits(limits)
        return limits

    async def _reserve_inference(self, limits: dict[str, Limit], prompt_tokens: int, n: int, max_tokens: int):
        """Count a Generate call as one request per completion and prompt + max_tokens tokens:
        the most the call can use, as API quotas count it, so the limit holds before the
        answer's real length is known."""
        if INFERENCE_RESOURCE in limits:
            await self.limiter.acquire(INFERENCE_RESOURCE, float(n), float(prompt_tokens + n * max_tokens))

    async def _tokenizer(self, task: events_pb2.EpisodeTask) -> Tokenizer:
        try:
            return await self.tokenizers.aget(task.tokenizer)
        except ValueError as exc:  # a bad task, not one to retry
            raise EnvironmentError_(f"task.tokenizer (the run's model.tokenizer): {exc}") from None

    async def run(self, task: events_pb2.EpisodeTask) -> common_pb2.Rollout:
        """One episode, one rollout (a forking task gives several: use `run_all`)."""
        if task.branches > 1:
            raise EnvironmentError_(
                f"task.branches: {task.branches} continuations make {task.branches} rollouts; "
                "submit forking tasks to the episode queue"
            )
        return (await self.run_all(task))[0]

    async def run_all(self, task: events_pb2.EpisodeTask) -> list[common_pb2.Rollout]:
        """The task's rollouts: one, or `task.branches` continuations of a shared prefix."""
        if task.branches < 0 or task.branch_at_turn < 0:
            raise EnvironmentError_("task.branches, task.branch_at_turn: must be >= 0")
        branches = max(1, task.branches)
        if branches > MAX_BRANCHES:
            raise EnvironmentError_(f"task.branches: at most {MAX_BRANCHES}, got {branches}")
        tokenizer = await self._tokenizer(task)
        env, payload, source = await self._environment(task, tokenizer)
        # One session for the prefix and every branch: the router keeps them on the replica
        # whose prefix cache holds the shared tokens.
        session_id = (
            f"{task.run_id}/{rollout_id_for(task.run_id, task.task_id, task.group_id, task.sample_index)}"
        )
        sampling = self._sampling(task, tokenizer)
        # Every environment the task makes (forks included) is closed however the task ends: a
        # repository workspace must not outlive its episode.
        envs = [env]
        try:
            return await self._play_task(task, env, payload, source, tokenizer, sampling, session_id, envs)
        finally:
            for made in envs:
                try:
                    await made.close()
                except Exception:
                    log.exception(
                        "closing the %s environment of task %s failed", task.environment, task.task_id
                    )

    async def _play_task(
        self,
        task: events_pb2.EpisodeTask,
        env: Environment,
        payload: dict,
        source: str,
        tokenizer: Tokenizer,
        sampling: common_pb2.SamplingParams,
        session_id: str,
        envs: list[Environment],
    ) -> list[common_pb2.Rollout]:
        """run_all's episodes; every environment made on the way is appended to `envs`."""
        branches = max(1, task.branches)
        task_json = json.dumps(payload)
        episode = await self._start(task, env, payload, tokenizer)
        episode.rollout.task_source = source
        if source:  # the run's dataset names the row's source (dataset.source_field)
            episode.source = source
        if branches == 1:
            await self._play(episode, task, sampling, session_id, 0)
            return [await self._finish(episode, task, task_json, None, 1)]

        async def fork(of: _Episode) -> _Episode:
            made = await of.fork()
            envs.append(made.env)
            return made

        snapshot: _Episode | None = None
        while not episode.done and episode.turn < task.branch_at_turn:
            if snapshot is not None:
                await snapshot.env.close()  # superseded by the next turn's snapshot
            snapshot = await fork(episode)
            await self._turn(episode, task, sampling, session_id, 0)
        if not episode.done:
            forks = [episode, *[await fork(episode) for _ in range(branches - 1)]]
            first = forks
        else:  # over before the fork point: fork before its last model turn, it is branch 0
            assert snapshot is not None
            forks = [episode, *[await fork(snapshot) for _ in range(branches - 1)]]
            first = forks[1:]
        seed = self._seed(sampling, task, first[0].turn, 0)
        if seed and first[0] is not episode:
            seed += 1  # branch 0 already used the base seed at this turn
        turns = await self._sample(first[0], len(first), sampling, session_id, task, seed)
        await asyncio.gather(*(self._apply(ep, t, sampling) for ep, t in zip(first, turns, strict=True)))
        await asyncio.gather(
            *(self._play(ep, task, sampling, session_id, b) for b, ep in enumerate(forks) if not ep.done)
        )
        return list(
            await asyncio.gather(
                *(self._finish(ep, task, task_json, b, branches) for b, ep in enumerate(forks))
            )
        )

    # -- the pieces ------------------------------------------------------------------------------

    async def _environment(
        self, task: events_pb2.EpisodeTask, tokenizer: Tokenizer
    ) -> tuple[Environment, dict, str]:
        """The task's environment, its task and, for a dataset row, its task source."""
        env = make_environment(task.environment, task.environment_config_json or None, self.env_context)
        payload = parse_task(task.task_json)
        source = ""
        if is_index_task(payload):
            if task.dataset_json:  # a row of the run's dataset
                dataset = await self.datasets.get(
                    task.dataset_json,
                    task.environment,
                    task.environment_config_json or None,
                    task.tokenizer,
                    tokenizer,
                )
                payload = dataset.task(payload.get("split", "train"), payload["index"])
                source = str(payload.get(dataset.source_field, task.environment))
            else:
                payload = task_by_index(
                    task.environment,
                    payload["index"],
                    payload.get("seed", 0),
                    task.environment_config_json or None,
                )
        return env, payload, source

    def _sampling(self, task: events_pb2.EpisodeTask, tokenizer: Tokenizer) -> common_pb2.SamplingParams:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(task.sampling)
        if sampling.max_tokens <= 0:
            sampling.max_tokens = self.config.default_max_tokens
        eos = tokenizer.eos_token_id
        if eos not in sampling.stop_token_ids:
            sampling.stop_token_ids.append(eos)
        sampling.n = 1
        return sampling

    @staticmethod
    def _seed(
        sampling: common_pb2.SamplingParams, task: events_pb2.EpisodeTask, turn: int, branch: int
    ) -> int:
        """Per (sample, turn, branch) seed; 0 (unseeded) stays 0. A fork turn sampled as one
        n-completion request gets seed + b for completion b (the engines' convention); later
        turns of branch b > 0 are offset by a large prime so branches never share a seed."""
        if not task.sampling.seed:
            return 0
        return task.sampling.seed + 7919 * task.sample_index + turn + 104729 * branch

    async def _start(
        self, task: events_pb2.EpisodeTask, env: Environment, payload: dict, tokenizer: Tokenizer
    ) -> _Episode:
        limits = await self._limits_for(env)
        rollout = common_pb2.Rollout(
            run_id=task.run_id,
            group_id=task.group_id,
            task_id=task.task_id,
            environment=task.environment,
        )
        started = time.perf_counter()
        with plugin_code(type(env), "raised"):
            observation = await env.reset(payload)
        env_seconds = time.perf_counter() - started
        try:
            prompt_ids = tokenizer.apply_chat_template(
                observation, add_generation_prompt=True, tools=env.tool_schemas()
            )
        except ValueError as exc:  # the chat template refused the messages
            raise EnvironmentError_(str(exc)) from None
        rollout.turns.append(
            common_pb2.Turn(
                role=common_pb2.ROLE_USER,
                token_ids=prompt_ids,
                trainable=False,
                text=tokenizer.decode(prompt_ids),
            )
        )
        return _Episode(
            env,
            rollout,
            list(prompt_ids),
            limits,
            tokenizer,
            list(observation),
            source=task_source(task.environment, payload),
            env_seconds=env_seconds,
        )

    async def _sample(
        self,
        episode: _Episode,
        n: int,
        sampling: common_pb2.SamplingParams,
        session_id: str,
        task: events_pb2.EpisodeTask,
        seed: int,
    ) -> list[ModelTurn]:
        """n model turns from the episode's context: the generator's generate_n (one n-completion
        request over the router: the prefix is prefilled once)."""
        await self._reserve_inference(episode.limits, len(episode.context), n, sampling.max_tokens)
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.seed = seed
        key = LengthKey.of(task.run_id, episode.source, episode.turn, sampling.max_tokens)
        digest = prompt_digest(episode.context) if self.lengths is not None else b""
        expected = self.lengths.predict(key, task.group_id, digest).tokens if self.lengths is not None else 0
        started = time.perf_counter()
        if n == 1:
            turns = [
                await self.generate(
                    episode.context,
                    params,
                    session_id,
                    task.min_weight_version,
                    expected_output_tokens=expected,
                )
            ]
        else:
            turns = await self.generate.generate_n(
                episode.context,
                params,
                session_id,
                task.min_weight_version,
                n,
                expected_output_tokens=expected,
            )
        episode.gen_seconds += time.perf_counter() - started
        if self.lengths is not None:
            done = [len(t.token_ids) for t in turns if t.finish_reason != "abort"]
            self.lengths.observe(key, done, task.group_id, digest)
        return turns

    async def _apply(self, episode: _Episode, model: ModelTurn, sampling: common_pb2.SamplingParams) -> None:
        """Record the model's turn, let the environment answer, record its answer (masked)."""
        tokenizer = episode.tokenizer
        eos = tokenizer.eos_token_id
        rollout = episode.rollout
        episode.versions.append(model.weight_version)
        tools = episode.env.tool_schemas()
        episode.last_action = _reply_text(tokenizer, model.token_ids, keep_special=tools is not None)
        rollout.turns.append(
            common_pb2.Turn(
                role=common_pb2.ROLE_ASSISTANT,
                token_ids=model.token_ids,
                logprobs=model.logprobs,
                trainable=True,
                weight_version=model.weight_version,
                text=tokenizer.decode(model.token_ids),
                deployment=model.deployment,
                adapter=model.adapter,
            )
        )
        episode.context.extend(model.token_ids)
        episode.finish = model.finish_reason
        started = time.perf_counter()
        try:
            with plugin_code(type(episode.env), "raised"):
                step = await episode.env.step(episode.last_action)
        except PluginFailure:
            raise
        except EnvironmentError_ as exc:  # e.g. action too long: the episode ends, unrewarded
            episode.finish, episode.done = f"env_error: {exc}", True
            return
        finally:
            episode.env_seconds += time.perf_counter() - started
        episode.env_reward += step.reward
        episode.turn += 1
        if step.done:
            episode.finish = step.info.get("finish", episode.finish)
            episode.done = True
            return
        episode.messages.append({"role": "assistant", "content": episode.last_action})
        try:
            env_ids = tokenizer.chat_continuation(episode.messages, step.observation, tools=tools)
        except ValueError as exc:  # a template whose rendering of a longer chat is not an extension
            episode.finish, episode.done = f"env_error: {exc}", True
            return
        episode.messages.extend(step.observation)
        if model.token_ids and model.token_ids[-1] != eos:
            env_ids = [eos, *env_ids]  # close the cut-off turn so the template stays well formed
        rollout.turns.append(
            common_pb2.Turn(
                role=common_pb2.ROLE_ENVIRONMENT,
                token_ids=env_ids,
                trainable=False,
                text=tokenizer.decode(env_ids),
            )
        )
        episode.context.extend(env_ids)
        budget = episode.env.config.max_episode_tokens or self.config.max_episode_tokens
        if len(episode.context) + sampling.max_tokens > budget:
            episode.finish, episode.done = "max_episode_tokens", True
            episode.env_reward += await episode.env.end(episode.finish)

    async def _turn(self, episode, task, sampling, session_id: str, branch: int) -> None:
        seed = self._seed(sampling, task, episode.turn, branch)
        (model,) = await self._sample(episode, 1, sampling, session_id, task, seed)
        await self._apply(episode, model, sampling)

    async def _play(self, episode, task, sampling, session_id: str, branch: int) -> None:
        while not episode.done:
            await self._turn(episode, task, sampling, session_id, branch)

    async def _finish(
        self,
        episode: _Episode,
        task: events_pb2.EpisodeTask,
        task_json: str,
        branch: int | None,
        branches: int,
    ) -> common_pb2.Rollout:
        rollout = episode.rollout
        if branch is None:
            rollout.sample_index, rollout.group_size = task.sample_index, task.group_size
        else:
            rollout.sample_index = task.sample_index * branches + branch
            rollout.group_size = max(1, task.group_size) * branches
        rollout.rollout_id = rollout_id_for(
            task.run_id, task.task_id, task.group_id, task.sample_index, branch
        )
        rollout.min_weight_version = min(episode.versions)
        rollout.max_weight_version = max(episode.versions)
        rollout.generation_seconds = episode.gen_seconds
        rollout.environment_seconds = episode.env_seconds
        rollout.finish_reason = episode.finish
        reward_name = task.reward or episode.env.default_reward
        if self.score is not None and reward_name:
            transcript = "".join(t.text for t in rollout.turns)
            # A plugin reward's settings travel with each score (none: the call stays as it was).
            config = {"config_json": task.reward_config_json} if task.reward_config_json else {}
            score = await self.score(
                reward_name,
                task_json,
                episode.last_action,
                rollout.rollout_id,
                transcript,
                episode.env_reward,
                **config,
            )
            if score.plugin_error:
                raise PluginFailure(f"reward: plugin {score.plugin_error}")
            rollout.reward = score.score
            rollout.reward_components.update(score.components)
            if not score.ok:
                log.warning("rollout %s scored with failed components: %s", rollout.rollout_id, score.reasons)
        else:
            rollout.reward = episode.env_reward
            rollout.reward_components["environment"] = episode.env_reward
        return rollout
