"""The environment-sandbox wiring: the sandbox pool (local or a Ray fleet), the episode runner
and its rate limiter, the servicer, and the episode worker that consumes the bus."""

from __future__ import annotations

import asyncio
import logging
import os

from services.environment_sandbox.config import EnvServiceConfig
from services.kit.config.service import bus_url

log = logging.getLogger("looprl.environment_sandbox")
RAY_NAMESPACE = "environment-sandbox"


async def serve(cfg: EnvServiceConfig) -> None:
    from looprl.environment.v1 import environment_pb2_grpc
    from services.environment_sandbox.agent_loop import (
        EpisodeRunner,
        RewardClient,
        RouterGenerator,
    )
    from services.environment_sandbox.environments import EnvContext, repo_tasks, set_plugin_dirs
    from services.environment_sandbox.episode_worker import EpisodeWorker
    from services.environment_sandbox.ratelimit import RateLimiter, rate_limiter_actor
    from services.environment_sandbox.run_dataset import DatasetCache
    from services.environment_sandbox.sandbox import SandboxPool, SandboxUnavailable
    from services.environment_sandbox.servicer import EnvironmentSandboxServicer
    from services.kit.ray.cluster import connect_ray
    from services.kit.rpc.server import Service, open_channel
    from services.kit.usercode.plugins import plugin_dirs_from
    from services.modeling.tokenizer import TokenizerCache

    if cfg.sandbox_backend == "ray" or cfg.rate_limiter == "ray":
        connect_ray(cfg.ray_address, RAY_NAMESPACE)
    if cfg.sandbox_backend == "ray":
        from services.environment_sandbox.sandbox.fleet import SandboxFleet

        pool = SandboxFleet(cfg.fleet, cfg.sandbox)
    else:
        pool = SandboxPool(cfg.sandbox)

    def shared_limiter_actor():
        connect_ray(cfg.ray_address, RAY_NAMESPACE)
        return rate_limiter_actor(cfg.rate_limit_actor, cfg.rate_limit_namespace)

    limiter = (
        RateLimiter.lazy(shared_limiter_actor)
        if cfg.shared_limits(os.environ.get("RAY_ADDRESS", ""))
        else RateLimiter.local()
    )
    runner = None
    plugin_dirs = plugin_dirs_from(cfg.plugin_dirs)
    set_plugin_dirs(plugin_dirs)
    data_dirs = plugin_dirs_from(cfg.data_dirs)
    datasets = DatasetCache(plugin_dirs, data_dirs=data_dirs)
    repo_tasks.confine([*plugin_dirs, *data_dirs])  # repositories as datasets: only from there
    tokenizers = TokenizerCache(cfg.tokenizer)
    tokenizers.get()  # a default that does not load fails at start-up, not on the first task naming none
    if cfg.router_address:
        scorer = RewardClient(open_channel(cfg.reward_address)) if cfg.reward_address else None
        runner = EpisodeRunner(
            RouterGenerator(open_channel(cfg.router_address)),
            scorer,
            tokenizers,
            EnvContext(executor=pool.run_code, workspaces=pool.workspaces),
            cfg.loop,
            limiter=limiter,
            rate_limits=cfg.parsed_rate_limits,
            datasets=datasets,
        )
    service = Service("environment-sandbox", cfg)
    service.add(
        environment_pb2_grpc.add_EnvironmentSandboxServiceServicer_to_server,
        EnvironmentSandboxServicer(
            pool, runner, cfg.max_sessions, cfg.exec_max_code_bytes, datasets, tokenizers
        ),
    )
    state: dict = {}

    async def setup(_: Service) -> None:
        try:
            await pool.start()
        except SandboxUnavailable:
            # Fail closed for code only: Exec and code environments answer FAILED_PRECONDITION with
            # the reason (also in ListEnvironments), environments that run no code keep working.
            pass
        if runner is not None and cfg.consume_episodes:
            from services.kit.bus.client import Bus
            from services.kit.messages.run_errors import RunErrorReporter

            bus = await Bus.connect(bus_url(cfg), name="environment-sandbox")
            await bus.ensure_streams()
            worker = EpisodeWorker(
                bus,
                runner,
                cfg.worker,
                reporter=RunErrorReporter(bus, "environment-sandbox"),
            )
            state.update(bus=bus, worker=worker, task=asyncio.ensure_future(worker.run()))

    async def shutdown() -> None:
        if "worker" in state:
            await state["worker"].stop(cfg.grace_seconds)
            # The fetch loop ends by itself within one fetch timeout once stopped. Cancelling it
            # mid-fetch would leave that fetch's subscription undrained, and drain() would wait
            # out the client's whole drain timeout for it.
            try:
                await asyncio.wait_for(state["task"], timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                pass
            await state["worker"].reporter.close()
            await state["bus"].drain()
        await pool.close()

    service.on_shutdown(shutdown)
    await service.run(setup)
