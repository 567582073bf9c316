"""The environment-sandbox service with LOOPRL_ENV_SANDBOX_BACKEND=ray: Exec runs on sandbox
actors of the Ray cluster (still isolated), the fleet grows under concurrent Execs up to its max,
the code environment's tests run there too, and bad input is still answered with the right status."""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request

import grpc
import pytest

from looprl.environment.v1 import environment_pb2 as env_pb
from looprl.environment.v1 import environment_pb2_grpc as env_grpc
from tests.support.service_process import service_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox needs root"),
]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def ray_backend_service(ray_head):
    # RAY_ADDRESS and the token come from the environment the ray_head fixture exported.
    env = {
        "LOOPRL_ENV_CONSUME_EPISODES": "false",
        "LOOPRL_ENV_SANDBOX_BACKEND": "ray",
        "LOOPRL_ENV_FLEET__MIN_ACTORS": "1",
        "LOOPRL_ENV_FLEET__MAX_ACTORS": "2",
        "LOOPRL_ENV_FLEET__TARGET_QUEUE_PER_ACTOR": "2",
        "LOOPRL_ENV_SANDBOX__WARM_WORKERS": "1",
    }
    with service_process("services.environment_sandbox", env) as svc:
        yield svc.proc, svc.address, svc.metrics_url


async def test_exec_runs_on_ray_sandbox_actors(ray_backend_service):
    proc, address, metrics = ray_backend_service
    channel = grpc.aio.insecure_channel(address)
    stub = env_grpc.EnvironmentSandboxServiceStub(channel)
    try:
        out = await stub.Exec(
            env_pb.ExecRequest(code="import os\nprint(sum(range(10)), os.getuid() >= 600000)")
        )
        assert out.exit_code == 0 and out.stdout.split() == ["45", "True"], out
        assert "netns" in out.isolation
        assert metric(metrics, "looprl_sandbox_fleet_actors") == 1
        assert metric(metrics, "looprl_sandbox_fleet_executions_total") == 1

        # A burst deeper than one actor's share of the queue: the fleet scales to its max.
        code = "import time\ntime.sleep(0.4)\nprint('done')"
        outs = await asyncio.gather(*(stub.Exec(env_pb.ExecRequest(code=code)) for _ in range(8)))
        assert all(o.exit_code == 0 and o.stdout.strip() == "done" for o in outs)
        assert metric(metrics, "looprl_sandbox_fleet_peak_actors") == 2
        assert metric(metrics, "looprl_sandbox_fleet_executions_total") == 9

        # The code environment's executor is the fleet as well.
        task = '{"prompt": "def add(a, b)", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}'
        reset = await stub.Reset(env_pb.ResetRequest(environment="code", task_json=task))
        step = await stub.Step(
            env_pb.StepRequest(session_id=reset.session_id, action="def add(a, b): return a + b")
        )
        assert step.done and step.reward == 1.0
        assert metric(metrics, "looprl_sandbox_fleet_executions_total") == 10

        # Containment and validation behave as with the local pool.
        loop = await stub.Exec(env_pb.ExecRequest(code="while True: pass", timeout_seconds=1.0))
        assert loop.timed_out and loop.exit_code != 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Exec(env_pb.ExecRequest(code="1", timeout_seconds=1e6))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_seconds" in info.value.details()
    finally:
        await channel.close()
    proc.terminate()
    assert proc.wait(30) == 0
