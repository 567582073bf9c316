"""Episodes of every built-in environment through the real inference-router (tiny Qwen2 on a
real Ray replica), the real reward service process and a real nats-server: rollouts land on the
stream with environment tokens masked out, log-probs for every model token, and the weight
version they were sampled under."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.local_fleet import RouterProcess, load_weights, replica_actor, tiny_checkpoint
from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import (
    EpisodeRunner,
    RewardClient,
    RouterGenerator,
)
from services.environment_sandbox.environments import EnvContext, generate_tasks
from services.environment_sandbox.episode_worker import EpisodeWorker, WorkerConfig
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.local.infra import NatsServer, free_port
from services.kit.messages import rollouts as rollout_messages
from services.kit.rpc.server import open_channel
from services.modeling.tokenizer import CharTokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox"),
]
VERSION = 3


@pytest.fixture(scope="module")
def router(ray_client, tmp_path_factory):
    import ray

    deployments = [
        {
            "name": "main",
            "num_cpus": 0.5,
            "replicas": 1,
            "tensor_parallel": 1,
            "max_model_len": 512,
            "max_batch_size": 16,
        }
    ]
    proc = RouterProcess(
        deployments,
        tmp_path_factory.mktemp("router") / "router.log",
        status_interval_s=0.2,
    )
    try:
        proc.wait_serving(timeout=150)
        config, weights = tiny_checkpoint(seed=0)
        actor = replica_actor("main", 0, proc.namespace)
        ray.get(load_weights(actor, config, weights, VERSION), timeout=120)
        time.sleep(1.0)  # the router's status poll picks the version up
        yield proc.address
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reward_service():
    port = free_port()
    env = {**os.environ, "LOOPRL_GRPC_PORT": str(port), "LOOPRL_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "services.reward"], env=env)
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + 30
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "reward service did not start"
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(20)


async def test_episodes_of_each_environment_land_on_the_stream(router, reward_service, tmp_path):
    nats = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    pool = await SandboxPool(SandboxConfig(warm_workers=1)).start()
    tok = CharTokenizer()
    bus = await Bus.connect(nats.url, name="e2e")
    try:
        await bus.ensure_streams()
        run = "e2e"
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=6, seed=5)
        tasks = []
        for env_name, count in (("digits", 2), ("guess", 1), ("code", 1)):
            for i, payload in enumerate(generate_tasks(env_name, 1, seed=3) * count):
                config = '{"max_turns": 3}' if env_name == "guess" else ""
                tasks.append(
                    events_pb2.EpisodeTask(
                        run_id=run,
                        task_id=f"{env_name}-0",
                        group_id=f"{env_name}-g",
                        environment=env_name,
                        task_json=json.dumps(payload),
                        group_size=count,
                        sample_index=i,
                        sampling=sampling,
                        min_weight_version=VERSION,
                        environment_config_json=config,
                    )
                )
        for t in tasks:
            await bus.publish(subjects.episodes(run), t, msg_id=f"{t.task_id}-{t.sample_index}")

        runner = EpisodeRunner(
            RouterGenerator(open_channel(router)),
            RewardClient(open_channel(reward_service)),
            tok,
            EnvContext(executor=pool.run_code),
        )
        worker = EpisodeWorker(
            bus, runner, WorkerConfig(concurrency=8, durable="e2e"), filter_subject=subjects.episodes(run)
        )
        loop_task = asyncio.ensure_future(worker.run())
        deadline = time.monotonic() + 120
        # A task is acked (and leaves the work queue) only after its rollouts are published.
        while await bus.count(subjects.EPISODES, subjects.episodes(run)) > 0:
            assert time.monotonic() < deadline and not loop_task.done(), "episodes did not finish"
            await asyncio.sleep(0.2)
        await worker.stop()
        loop_task.cancel()
        # One message per task: its rollouts as a RolloutGroup.
        assert await bus.count(subjects.ROLLOUTS, subjects.rollouts(run)) == len(tasks)

        consumer = await bus.pull_consumer(subjects.ROLLOUTS, "e2e-check", subjects.rollouts(run))
        deliveries = await consumer.fetch(batch=20, timeout=2.0)
        rollouts = [r for d in deliveries for r in rollout_messages.rollouts_in(d)]
        assert len(rollouts) == len(tasks)
        assert len({r.rollout_id for r in rollouts}) == len(tasks)
        by_env = {}
        for r in rollouts:
            by_env.setdefault(r.environment, []).append(r)
            assert r.min_weight_version == r.max_weight_version == VERSION
            assert r.turns[0].role == common_pb2.ROLE_USER and not r.turns[0].trainable
            for turn in r.turns:
                if turn.role == common_pb2.ROLE_ASSISTANT:
                    assert turn.trainable and turn.weight_version == VERSION
                    assert len(turn.logprobs) == len(turn.token_ids) > 0
                    assert all(lp <= 0.0 for lp in turn.logprobs)
                else:
                    assert not turn.trainable and not turn.logprobs
            assert 0.0 <= r.reward <= 1.0
        assert {s.sample_index for s in by_env["digits"]} == {0, 1}
        assert "digits_partial" in by_env["digits"][0].reward_components
        assert "code_tests" not in by_env["code"][0].reward_components or by_env["code"][0].reward == 0.0
        guess = by_env["guess"][0]
        if len(guess.turns) > 2:  # a wrong first guess got feedback as a masked environment turn
            assert guess.turns[2].role == common_pb2.ROLE_ENVIRONMENT
    finally:
        await bus.close()
        await pool.close()
        nats.stop()


async def test_forked_episodes_through_the_real_router(router, tmp_path):
    """One guess task forked after its first turn into 3 continuations, one digits task forked at
    the prompt into 2 samples (group sampling in one task, one n=2 request): every branch lands on
    the stream as its own rollout before the task is acked, sharing the prefix tokens."""
    nats = NatsServer(state_dir=tmp_path / "nats", port=free_port()).start()
    bus = await Bus.connect(nats.url, name="e2e-fork")
    try:
        await bus.ensure_streams()
        run = "e2e-fork"
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=9)
        forks = {"guess": (1, 3, '{"max_turns": 3}'), "digits": (0, 2, "")}
        for env_name, (at, n, config) in forks.items():
            task = events_pb2.EpisodeTask(
                run_id=run,
                task_id=f"{env_name}-0",
                group_id=f"{env_name}-g",
                environment=env_name,
                task_json=json.dumps(generate_tasks(env_name, 1, seed=4)[0]),
                group_size=1,
                sampling=sampling,
                min_weight_version=VERSION,
                environment_config_json=config,
                branch_at_turn=at,
                branches=n,
            )
            await bus.publish(subjects.episodes(run), task, msg_id=task.task_id)
        runner = EpisodeRunner(RouterGenerator(open_channel(router)), None, CharTokenizer())
        worker = EpisodeWorker(
            bus,
            runner,
            WorkerConfig(concurrency=4, durable="e2e-fork"),
            filter_subject=subjects.episodes(run),
        )
        loop_task = asyncio.ensure_future(worker.run())
        deadline = time.monotonic() + 60
        while await bus.count(subjects.EPISODES, subjects.episodes(run)) > 0:  # acked after publishing
            assert time.monotonic() < deadline and not loop_task.done(), "forked episodes did not finish"
            await asyncio.sleep(0.2)
        await worker.stop()
        loop_task.cancel()

        consumer = await bus.pull_consumer(subjects.ROLLOUTS, "e2e-fork-check", subjects.rollouts(run))
        deliveries = await consumer.fetch(batch=10, timeout=2.0)
        rollouts = [r for d in deliveries for r in rollout_messages.rollouts_in(d)]
        assert len(rollouts) == 5 and len({r.rollout_id for r in rollouts}) == 5
        by_env: dict[str, list] = {}
        for r in rollouts:
            by_env.setdefault(r.environment, []).append(r)
            assert r.min_weight_version == r.max_weight_version == VERSION
            for turn in r.turns:
                assert turn.trainable == (turn.role == common_pb2.ROLE_ASSISTANT)
                assert len(turn.logprobs) == (len(turn.token_ids) if turn.trainable else 0)
        for env_name, (_, n, _) in forks.items():
            group = sorted(by_env[env_name], key=lambda r: r.sample_index)
            assert [r.sample_index for r in group] == list(range(n))
            assert {(r.group_id, r.group_size) for r in group} == {(f"{env_name}-g", n)}
        guess = sorted(by_env["guess"], key=lambda r: r.sample_index)
        if len(guess[0].turns) > 2:  # the first guess missed, so the fork happened after turn 1
            shared = [list(t.token_ids) for t in guess[0].turns[:3]]
            assert all([list(t.token_ids) for t in r.turns[:3]] == shared for r in guess)
        digits = by_env["digits"]
        assert digits[0].turns[0].token_ids == digits[1].turns[0].token_ids
    finally:
        await bus.close()
        nats.stop()
