"""gRPC adapters of the agent loop: the inference-router as a Generator, the reward service as
a Scorer (the service wires these; tests may pass their own implementations)."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from typing import Any

from opentelemetry import trace

from looprl.common.v1 import common_pb2
from services.environment_sandbox.model_io import Generator, ModelTurn, Score, Scorer

_tracer = trace.get_tracer("looprl.environment_sandbox.clients")

# The run the current episode serves, set by the episode worker: the router reports the replica
# failures a request meets to it, without every environment passing the run along.
CURRENT_RUN: contextvars.ContextVar[str] = contextvars.ContextVar("looprl_current_run", default="")


class RouterGenerator(Generator):
    """Generator over InferenceRouterService.Generate."""

    def __init__(self, channel: Any, timeout_s: float = 120.0) -> None:
        from looprl.inference.v1 import inference_pb2_grpc

        self.stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
        self.timeout_s = timeout_s

    async def __call__(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> ModelTurn:
        turns = await self.generate_n(
            prompt_ids,
            sampling,
            session_id,
            min_weight_version,
            1,
            expected_output_tokens=expected_output_tokens,
        )
        return turns[0]

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        session_id: str,
        min_weight_version: int,
        n: int,
        /,
        *,
        expected_output_tokens: int = 0,
    ) -> list[ModelTurn]:
        """n completions of one prompt in one request (a fork: the prefix is prefilled once);
        `expected_output_tokens` is the predicted length of each (0: unknown), what the router
        routes by."""
        from looprl.inference.v1 import inference_pb2

        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.n = n
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=params,
            session_id=session_id,
            min_weight_version=min_weight_version,
            request_id=uuid.uuid4().hex,
            run_id=CURRENT_RUN.get(),
            expected_output_tokens=max(0, int(expected_output_tokens)),
        )
        response = await self.stub.Generate(request, timeout=self.timeout_s)
        if len(response.completions) != n:
            raise RuntimeError(f"router answered {len(response.completions)} completions, asked for {n}")
        return [
            ModelTurn(
                list(c.token_ids),
                list(c.logprobs),
                c.finish_reason,
                c.weight_version,
                response.deployment,
                response.adapter,
            )
            for c in response.completions
        ]


class RewardClient(Scorer):
    """Scorer over RewardService. Scores asked for in the same event-loop turn (the samples of a
    group finish together) go out as one ScoreBatch call: one round trip per group instead of one
    per rollout. A reward service without ScoreBatch (UNIMPLEMENTED) is called with Score from then
    on; a batch refused for one bad request is retried request by request, so each episode gets its
    own answer or error."""

    def __init__(self, channel: Any, timeout_s: float = 60.0, max_batch: int = 64) -> None:
        from looprl.reward.v1 import reward_pb2_grpc

        self.stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self.batching = True
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._callers: list[Any] = []  # span context of each pending score's episode
        self._sending: set[asyncio.Task] = set()

    async def __call__(
        self,
        reward: str,
        task_json: str,
        completion: str,
        rollout_id: str,
        transcript: str,
        env_reward: float | None,
        /,
        *,
        config_json: str = "",
    ) -> Score:
        from looprl.reward.v1 import reward_pb2

        request = reward_pb2.ScoreRequest(
            reward=reward,
            task_json=task_json,
            completion=completion,
            rollout_id=rollout_id,
            transcript=transcript,
            reward_config_json=config_json,
        )
        if env_reward is not None:
            request.environment_reward = env_reward
        if not self.batching:
            return _score(await self.stub.Score(request, timeout=self.timeout_s))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        # The batch call is made in the first caller's trace and linked to the others' episodes.
        self._pending.append((request, future))
        self._callers.append(trace.get_current_span().get_span_context())
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # after every coroutine ready in this turn has queued its score
        elif len(self._pending) >= self.max_batch:
            self._flush()
        return _score(await future)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        callers, self._callers = self._callers, []
        if batch:
            task = asyncio.ensure_future(self._send_traced(batch, callers))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_traced(self, batch: list[tuple[Any, asyncio.Future]], callers: list[Any]) -> None:
        """_send inside a span of the first caller's episode, linked to every other caller's."""
        from services.kit.telemetry import tracing as telemetry

        first = trace.set_span_in_context(trace.NonRecordingSpan(callers[0])) if callers else None
        links, dropped = telemetry.links(callers[1:])
        with _tracer.start_as_current_span(
            "score batch",
            context=first,
            links=links,
            attributes={telemetry.ATTR.ROLLOUTS: len(batch), telemetry.ATTR.LINKS_DROPPED: dropped},
        ):
            await self._send(batch)

    async def _send(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        import grpc

        from looprl.reward.v1 import reward_pb2

        if len(batch) == 1:
            await self._send_one(*batch[0])
            return
        try:
            response = await self.stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(requests=[r for r, _ in batch]), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self.batching = False
            if code in (
                grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            ):
                await asyncio.gather(*(self._send_one(r, f) for r, f in batch))
                return
            _fail(batch, exc)
            return
        except Exception as exc:
            _fail(batch, exc)
            return
        for (_, future), result in zip(batch, response.responses, strict=True):
            if not future.done():
                future.set_result(result)

    async def _send_one(self, request: Any, future: asyncio.Future) -> None:
        try:
            result = await self.stub.Score(request, timeout=self.timeout_s)
        except Exception as exc:
            _fail([(request, future)], exc)
            return
        if not future.done():
            future.set_result(result)


def _fail(batch: list[tuple[Any, asyncio.Future]], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _score(response: Any) -> Any:
    return Score(
        response.score,
        {c.name: c.score for c in response.components if c.ok},
        response.ok,
        {c.name: c.reason for c in response.components if not c.ok},
        response.plugin_error,
    )
