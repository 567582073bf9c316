"""The inference-router wiring: the Router and its DeploymentManager, the servicer, the
deployments the config names, each run's own deployments (runs.py), and the weight events it
follows."""

from __future__ import annotations

import asyncio
import logging

from services.inference_router.config import RouterConfig
from services.kit.config.service import bus_url

log = logging.getLogger("looprl.inference_router")


def build_router(cfg: RouterConfig):
    from services.inference_router.policies import RoutingPolicy, SessionAffinity
    from services.inference_router.router import Router

    return Router(RoutingPolicy(affinity=SessionAffinity(cfg.max_sessions)), cfg)


async def serve(cfg: RouterConfig) -> None:
    from looprl.inference.v1 import inference_pb2_grpc
    from services.inference_router import targets
    from services.inference_router.deployments import DeploymentManager
    from services.inference_router.runs import RunDeployments
    from services.inference_router.servicer import InferenceRouterServicer
    from services.kit.ray.cluster import connect_ray
    from services.kit.rpc.server import Service

    router = build_router(cfg)
    manager = DeploymentManager(router, cfg)
    router._on_replica_restarted = manager.request_sync
    router._on_replica_broken = manager.recreate_replica
    service = Service("inference-router", cfg)
    service.add(
        inference_pb2_grpc.add_InferenceRouterServiceServicer_to_server,
        InferenceRouterServicer(router, manager),
    )

    background: list[asyncio.Task] = []
    runs = None
    # Prometheus finds every replica's /metrics here (HTTP service discovery).
    service.metrics_routes[targets.PATH] = targets.targets_route(router, asyncio.get_running_loop())

    async def setup(_: Service) -> None:
        if cfg.deployments:
            await asyncio.to_thread(connect_ray, cfg.ray_address, cfg.namespace)
        for i, spec in enumerate(cfg.deployments):
            await manager.start(spec, where=f"deployments[{i}]")
            log.info("deployment %s started with %d replica(s)", spec.name, spec.replicas)
        router.start_polling()

        async def follow() -> None:
            from services.kit.messages.run_errors import RunErrorReporter

            try:
                bus = await manager.follow_weight_events(bus_url(cfg))
            except Exception as exc:  # the bus is a hint; status polls still track versions
                log.warning("not following weight events or runs (%s); relying on status polls", exc)
                return
            reporter = RunErrorReporter(bus, "inference-router")
            router.report_to_run = reporter.report
            service.on_shutdown(reporter.close)
            if cfg.starts_run_deployments:
                nonlocal runs
                runs = RunDeployments(
                    manager, router, connect=lambda: connect_ray(cfg.ray_address, cfg.namespace)
                )
                await runs.start(bus)

        # In the background: serving never waits on the bus.
        background.append(asyncio.get_running_loop().create_task(follow()))

    async def shutdown() -> None:
        for task in background:
            task.cancel()
        if runs is not None:
            await runs.stop()
        await router.close()
        await manager.stop()

    service.on_shutdown(shutdown)
    await service.run(setup)
