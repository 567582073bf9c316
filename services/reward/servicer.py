"""RewardService over gRPC: Score and ScoreBatch (by reward name or plugin reference), ListRewards and
LoadReward (a run's reward, its settings and a trial score, before the run starts)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from looprl.reward.v1 import reward_pb2, reward_pb2_grpc
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.kit.telemetry.metrics import observe
from services.kit.usercode import plugins
from services.reward import metrics
from services.reward.functions import BadRewardConfig
from services.reward.registry import RewardRegistry, UnknownReward
from services.reward.verifiers import ScoreInput

MAX_COMPLETION_CHARS = 1 << 20
MAX_BATCH = 1024


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, registry: RewardRegistry) -> None:
        self.registry = registry
        metrics.init_rewards(s.name for s in registry.specs())

    async def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        return await self._score(*self._validated(request))

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: Any
    ) -> reward_pb2.ScoreBatchResponse:
        if len(request.requests) > MAX_BATCH:
            raise InvalidArgument(f"requests: {len(request.requests)} requests, at most {MAX_BATCH} per call")
        # All validated before any is scored: a bad request fails the call without side effects.
        inputs = [self._validated(r, f"requests[{i}].") for i, r in enumerate(request.requests)]
        responses = await asyncio.gather(*(self._score(*item) for item in inputs))
        return reward_pb2.ScoreBatchResponse(responses=responses)

    def _validated(self, request: reward_pb2.ScoreRequest, where: str = "") -> tuple[str, ScoreInput, str]:
        if not request.reward:
            raise InvalidArgument(f"{where}reward: required (name of a registered reward)")
        if request.reward_config_json and not self.registry.is_plugin(request.reward):
            raise InvalidArgument(f"{where}reward_config_json: only a plugin reward takes settings")
        if not self.registry.is_plugin(request.reward):
            try:
                self.registry.get(request.reward)
            except UnknownReward as exc:
                raise NotFound(f"{where}{exc.args[0]}") from None
        try:
            task = json.loads(request.task_json) if request.task_json else {}
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}task_json: not valid JSON: {exc}") from None
        if not isinstance(task, dict):
            raise InvalidArgument(f"{where}task_json: must be a JSON object")
        if len(request.completion) > MAX_COMPLETION_CHARS:
            raise InvalidArgument(f"{where}completion: longer than {MAX_COMPLETION_CHARS} characters")
        env_reward = request.environment_reward if request.HasField("environment_reward") else None
        if env_reward is not None and not math.isfinite(env_reward):
            raise InvalidArgument(f"{where}environment_reward: must be finite")
        return (
            request.reward,
            ScoreInput(task, request.completion, request.transcript, env_reward, request.rollout_id),
            request.reward_config_json,
        )

    async def _score(self, reward: str, item: ScoreInput, config_json: str = "") -> reward_pb2.ScoreResponse:
        started = time.perf_counter()
        outcome = await self.registry.score(reward, item, config_json)
        observe(metrics.SECONDS.labels(reward), time.perf_counter() - started)
        metrics.SCORES.labels(reward).observe(outcome.score)
        return reward_pb2.ScoreResponse(
            score=outcome.score,
            ok=outcome.ok,
            components=[
                reward_pb2.ComponentScore(
                    name=c.name, score=c.score, weight=c.weight, ok=c.ok, reason=c.reason
                )
                for c in outcome.components
            ],
            plugin_error=outcome.plugin_error,
        )

    async def LoadReward(
        self, request: reward_pb2.LoadRewardRequest, context: Any
    ) -> reward_pb2.LoadRewardResponse:
        if not request.reward:
            raise InvalidArgument("reward: required")
        if not self.registry.is_plugin(request.reward):
            if request.config_json:
                raise InvalidArgument("reward.config: only a plugin reward (reward.function) takes settings")
            try:
                spec = self.registry.get(request.reward)
            except UnknownReward:
                known = ", ".join(s.name for s in self.registry.specs())
                raise NotFound(
                    f"unknown reward {request.reward!r}: the reward service serves {known}; a plugin is "
                    "named 'module:function', 'file.py:function' or by a looprl.rewards entry point"
                ) from None
            return reward_pb2.LoadRewardResponse(
                reward=reward_pb2.RewardInfo(name=spec.name, kind=spec.kind, description=spec.description)
            )
        try:
            fn = await asyncio.to_thread(self.registry.plugin, request.reward, request.config_json, True)
        except BadRewardConfig as exc:
            raise InvalidArgument(str(exc)) from None
        except plugins.PluginError as exc:
            raise FailedPrecondition(f"reward.function: plugin {exc}") from None
        # Trials are validated like scores, then scored: a plugin that fails one fails the run now.
        trials = [self._validated(t, f"trials[{i}].") for i, t in enumerate(request.trials)]
        reply = reward_pb2.LoadRewardResponse(
            reward=reward_pb2.RewardInfo(
                name=request.reward,
                kind="plugin",
                description=(fn.fn.__doc__ or "").strip().split("\n")[0],
                plugin=fn.loaded.origin,
            )
        )
        for _, item, _ in trials:
            response = await self._score(request.reward, item, request.config_json)
            if response.plugin_error:
                raise FailedPrecondition(f"reward.function: plugin {response.plugin_error} (on a trial task)")
            reply.trials.append(response)
        return reply

    async def ListRewards(
        self, request: reward_pb2.ListRewardsRequest, context: Any
    ) -> reward_pb2.ListRewardsResponse:
        return reward_pb2.ListRewardsResponse(
            rewards=[
                reward_pb2.RewardInfo(name=s.name, kind=s.kind, description=s.description)
                for s in self.registry.specs()
            ]
        )


class SandboxExecutor:
    """Code-test executor over EnvironmentSandboxService.Exec."""

    def __init__(self, channel: Any) -> None:
        from looprl.environment.v1 import environment_pb2_grpc

        self.stub = environment_pb2_grpc.EnvironmentSandboxServiceStub(channel)

    async def __call__(self, code: str, timeout_s: float = 0.0, stdin: str = "") -> Any:
        from looprl.environment.v1 import environment_pb2

        request = environment_pb2.ExecRequest(
            language="python", code=code, stdin=stdin, timeout_seconds=timeout_s
        )
        return await self.stub.Exec(request, timeout=timeout_s + 30)
