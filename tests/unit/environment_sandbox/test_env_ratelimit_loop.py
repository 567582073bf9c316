"""Rate limits on the agent-loop path (process-local limiter): the loop reserves the 'inference'
resource before every model turn, environments reserve their own resources, limits come from the
environment config and the service config (the service's win), and bad definitions name the field."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime
from services.environment_sandbox.environments import EnvContext, EnvironmentError_, make_environment
from services.environment_sandbox.ratelimit import Limit, LimitError, RateLimiter, TokenBuckets, parse_limits
from services.modeling.tokenizer import CharTokenizer

TOK = CharTokenizer()


class StampingPolicy:
    """Always guesses 1 (the secret is never 1, so every episode uses all its turns)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.prompt_lens: list[int] = []

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        self.stamps.append(time.monotonic())
        self.prompt_lens.append(len(prompt_ids))
        ids = [*TOK.encode("1"), TOK.eos_token_id]
        return ModelTurn(ids, [-0.1] * len(ids), "stop", 0)


def guess_task(i: int, config: dict) -> events_pb2.EpisodeTask:
    return events_pb2.EpisodeTask(
        run_id="r",
        task_id=f"t{i}",
        group_id="g",
        environment="guess",
        task_json=json.dumps({"secret": 7, "high": 8}),
        sampling=common_pb2.SamplingParams(max_tokens=3),
        environment_config_json=json.dumps(config),
    )


def max_in_window(stamps: list[float], window: float) -> int:
    stamps = sorted(stamps)
    return max(sum(1 for t in stamps[i:] if t - s < window) for i, s in enumerate(stamps))


async def test_environment_config_limits_inference_calls_of_concurrent_episodes():
    policy = StampingPolicy()
    runner = EpisodeRunner(OneAtATime(policy), None, TOK)
    config = {"max_turns": 3, "rate_limits": {"inference": {"requests_per_s": 40, "request_burst": 2}}}
    started = time.monotonic()
    rollouts = await asyncio.gather(*(runner.run(guess_task(i, config)) for i in range(4)))
    elapsed = time.monotonic() - started
    assert len(policy.stamps) == 12 and all(len(r.turns) == 6 for r in rollouts)
    # 12 requests at 40/s with a burst of 2: at least (12 - 2) / 40 s, never more than burst+rate*window.
    assert elapsed >= 10 / 40 - 0.02
    assert max_in_window(policy.stamps, 0.1) <= 2 + 40 * 0.1 + 1
    assert runner.limiter.waited_s > 0


async def test_tokens_per_s_counts_prompt_plus_max_tokens_and_service_limits_win():
    now = [0.0]
    buckets = TokenBuckets(clock=lambda: now[0])
    limiter = RateLimiter(local=buckets)
    policy = StampingPolicy()
    service = {"inference": Limit(tokens_per_s=1e9, token_burst=1e9)}
    runner = EpisodeRunner(OneAtATime(policy), None, TOK, limiter=limiter, rate_limits=service)
    # The environment asks for a tight limit; the operator's (service) limit replaces it.
    config = {"max_turns": 2, "rate_limits": {"inference": {"tokens_per_s": 1}}}
    await runner.run(guess_task(0, config))
    assert buckets.limits["inference"] == service["inference"]
    used = 1e9 - buckets._buckets["inference"][1].level
    assert used == pytest.approx(sum(policy.prompt_lens) + 2 * 3)  # prompt + max_tokens per call


async def test_environment_external_calls_reserve_their_resource():
    calls = []

    async def executor(code: str, timeout_s: float = 0.0, **_):
        calls.append(time.monotonic())

        class R:
            stdout, exit_code, killed_reason = "", 1, ""

        return R()

    limiter = RateLimiter.local()
    limits = parse_limits({"sandbox": {"requests_per_s": 20, "request_burst": 1}}, "x")
    await limiter.ensure(limits)
    context = EnvContext(executor=executor, limiter=limiter, limits=limits)
    task = {"prompt": "def f(): ...", "tests": ["assert True"]}

    async def one() -> None:
        env = make_environment("code", None, context)
        await env.reset(task)
        await env.step("def f(): pass")

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(4)))
    assert len(calls) == 4 and time.monotonic() - started >= 3 / 20 - 0.02
    assert await EnvContext(limiter=limiter).acquire("sandbox") == 0.0  # no limit named here


def test_configure_is_idempotent_and_keeps_the_drained_level():
    now = [0.0]
    buckets = TokenBuckets(clock=lambda: now[0])
    buckets.configure("api", Limit(requests_per_s=10, request_burst=2))
    assert buckets.reserve("api") == 0 and buckets.reserve("api") == 0
    buckets.configure("api", Limit(requests_per_s=10, request_burst=2))  # another process starting
    assert buckets.reserve("api") == pytest.approx(0.1)
    buckets.configure("api", Limit(requests_per_s=20, request_burst=2))  # changed: level kept
    assert buckets.reserve("api") == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"inference": {"requests_per_s": "fast"}}', "rate_limits.inference.requests_per_s"),
        ('{"inference": {"rps": 3}}', "rate_limits.inference.rps"),
        ('{"inference": {"tokens_per_s": -1}}', "rate_limits.inference.tokens_per_s"),
        ('{"inference": 5}', "rate_limits.inference"),
        ("[1]", "rate_limits"),
    ],
)
def test_bad_limits_name_the_field(raw, field):
    with pytest.raises(LimitError, match=field.replace(".", r"\.")):
        parse_limits(raw, "rate_limits")
    with pytest.raises(EnvironmentError_, match="environment_config." + field.replace(".", r"\.")):
        make_environment("guess", json.dumps({"rate_limits": json.loads(raw)}))
