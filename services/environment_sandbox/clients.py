"""gRPC adapters of the agent loop: the inference-router as a Generator, the reward service as
a Scorer (the service wires these; tests may pass their own callables)."""

from __future__ import annotations

import uuid
from typing import Any


class RouterGenerator:
    """Generator over InferenceRouterService.Generate."""

    def __init__(self, channel: Any, timeout_s: float = 120.0) -> None:
        from looprl.inference.v1 import inference_pb2_grpc

        self.stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        self.timeout_s = timeout_s

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        return (await self.generate_n(prompt_ids, sampling, session_id, min_weight_version, 1))[0]

    async def generate_n(self, prompt_ids, sampling, session_id, min_weight_version, n: int) -> list:
        """n completions of one prompt in one request (a fork: the prefix is prefilled once)."""
        from looprl.common.v1 import common_pb2
        from looprl.inference.v1 import inference_pb2
        from services.environment_sandbox.agent_loop import ModelTurn

        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.n = n
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=params,
            session_id=session_id,
            min_weight_version=min_weight_version,
            request_id=uuid.uuid4().hex,
        )
        response = await self.stub.Generate(request, timeout=self.timeout_s)
        if len(response.completions) != n:
            raise RuntimeError(f"router answered {len(response.completions)} completions, asked for {n}")
        return [
            ModelTurn(list(c.token_ids), list(c.logprobs), c.finish_reason, c.weight_version)
            for c in response.completions
        ]


class RewardClient:
    """Scorer over RewardService.Score."""

    def __init__(self, channel: Any, timeout_s: float = 60.0) -> None:
        from looprl.reward.v1 import reward_pb2_grpc

        self.stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.timeout_s = timeout_s

    async def __call__(self, reward, task_json, completion, rollout_id, transcript, env_reward):
        from looprl.reward.v1 import reward_pb2
        from services.environment_sandbox.agent_loop import Score

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
