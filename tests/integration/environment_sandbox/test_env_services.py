"""The environment-sandbox and reward services as real processes: Exec, sessions, scoring (code
tests through the sandbox service), and bad input answered with the right status while the
services keep serving."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from looprl.environment.v1 import environment_pb2 as env_pb
from looprl.environment.v1 import environment_pb2_grpc as env_grpc
from looprl.reward.v1 import reward_pb2, reward_pb2_grpc
from tests.support.service_process import service_process

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="sandbox needs root")]


@pytest.fixture(scope="module")
def services():
    with (
        service_process("services.environment_sandbox", {"LOOPRL_ENV_CONSUME_EPISODES": "false"}, 30) as env,
        service_process("services.reward", {"LOOPRL_REWARD_SANDBOX_ADDRESS": env.address}, 30) as rew,
    ):
        yield env.address, rew.address


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_exec_sessions_and_listing(services):
    env = env_grpc.EnvironmentSandboxServiceStub(grpc.insecure_channel(services[0]))
    out = env.Exec(env_pb.ExecRequest(language="python", code="print(sum(range(10)))"))
    assert out.stdout.strip() == "45" and out.exit_code == 0 and "netns" in out.isolation
    listing = env.ListEnvironments(env_pb.ListEnvironmentsRequest())
    assert {"digits", "guess", "code"} <= {e.name for e in listing.environments}
    sandbox = listing.sandbox
    assert sandbox.isolation_level == "full" and not sandbox.unavailable and not sandbox.missing_isolation
    assert {"netns", "rootfs", "cgroup", "seccomp"} <= set(sandbox.isolation) and sandbox.memory_bytes > 0
    assert out.memory_peak_bytes > 0
    reset = env.Reset(
        env_pb.ResetRequest(environment="guess", task_json=json.dumps({"secret": 5, "high": 8}))
    )
    step = env.Step(env_pb.StepRequest(session_id=reset.session_id, action="3"))
    assert not step.done and step.observation[0].content == "higher"
    step = env.Step(env_pb.StepRequest(session_id=reset.session_id, action="5"))
    assert step.done and step.reward > 0


def test_bad_input_names_the_field_and_service_keeps_serving(services):
    env = env_grpc.EnvironmentSandboxServiceStub(grpc.insecure_channel(services[0]))
    code, details = _code(lambda: env.Reset(env_pb.ResetRequest(environment="nope", task_json="{}")))
    assert code == grpc.StatusCode.NOT_FOUND and "environment" in details
    code, details = _code(lambda: env.Reset(env_pb.ResetRequest(environment="digits", task_json="{oops")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_json" in details
    code, details = _code(
        lambda: env.Reset(env_pb.ResetRequest(environment="digits", task_json='{"digits": 5}'))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_json.digits" in details
    for key in ("sub/", "../x", "/abs", "a\0b"):
        code, details = _code(lambda key=key: env.Exec(env_pb.ExecRequest(code="print(1)", files={key: "x"})))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"files[{key!r}]"), details
    reset = env.Reset(env_pb.ResetRequest(environment="digits", task_json='{"digits": "12"}'))
    code, details = _code(
        lambda: env.Step(env_pb.StepRequest(session_id=reset.session_id, action="1" * 5000))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "action" in details and "limit" in details
    code, details = _code(lambda: env.Step(env_pb.StepRequest(session_id="missing", action="1")))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    code, details = _code(lambda: env.Exec(env_pb.ExecRequest(language="ruby", code="puts 1")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "language" in details
    code, details = _code(lambda: env.Exec(env_pb.ExecRequest(code="1", files={"../x": "y"})))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "files" in details
    code, details = _code(lambda: env.RunEpisode(env_pb.RunEpisodeRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert env.Exec(env_pb.ExecRequest(code="print('ok')")).stdout.strip() == "ok"

    rew = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(services[1]))
    code, details = _code(lambda: rew.Score(reward_pb2.ScoreRequest(reward="missing", task_json="{}")))
    assert code == grpc.StatusCode.NOT_FOUND and "reward" in details
    code, details = _code(lambda: rew.Score(reward_pb2.ScoreRequest(reward="exact", task_json="[1")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_json" in details
    assert (
        rew.Score(reward_pb2.ScoreRequest(reward="exact", task_json='{"answer": "a"}', completion="a")).score
        == 1
    )


def test_reward_service_scores_code_through_the_sandbox_service(services):
    rew = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(services[1]))
    task = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 1"]})
    out = rew.Score(
        reward_pb2.ScoreRequest(reward="code", task_json=task, completion="def add(a, b): return a + b")
    )
    assert out.ok and out.score == pytest.approx(0.5)
    failed = rew.Score(reward_pb2.ScoreRequest(reward="guess", task_json="{}", completion="3"))
    assert not failed.ok and "environment_reward" in failed.components[0].reason
    listed = {r.name: r.kind for r in rew.ListRewards(reward_pb2.ListRewardsRequest()).rewards}
    assert listed["code"] == "composite" and listed["exact"] == "verifier"
