"""Wires the gateway process: bus, run manager, gRPC service, HTTP API."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from gateway.admission import Peers
from gateway.auth import TokenAuth
from gateway.config import GatewayConfig
from gateway.http import HttpApi
from gateway.metrics import follow_runs
from gateway.queue import ClusterResources
from gateway.run_store import RunStore
from gateway.servicer import GatewayServicer, RunManager
from looprl.environment.v1 import environment_pb2_grpc
from looprl.gateway.v1 import gateway_pb2_grpc
from looprl.inference.v1 import inference_pb2_grpc
from looprl.packer.v1 import packer_pb2_grpc
from looprl.reward.v1 import reward_pb2_grpc
from services.kit.bus import subjects
from services.kit.bus.client import Bus
from services.kit.config.service import bus_url
from services.kit.local.infra import free_port
from services.kit.rpc.server import Service, open_channel
from services.modeling.tokenizer import TokenizerCache


async def serve(config: GatewayConfig) -> None:
    service = Service("gateway", config, public=True)
    auth = TokenAuth.from_config(config)
    # Servicer first (handlers must be registered before the port opens); its run manager needs
    # the bus, connected in setup. The kit refuses RPCs with UNAVAILABLE until setup finished.
    servicer = GatewayServicer(None, auth)  # type: ignore[arg-type]
    service.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer)

    async def setup(svc: Service) -> None:
        bus = await Bus.connect(bus_url(config), name="gateway")
        await bus.ensure_streams()
        router = None
        if config.router_address:
            router = inference_pb2_grpc.InferenceRouterServiceStub(open_channel(config.router_address))
        # Admission asks the services a run needs whether they serve it, before the run exists; the
        # stall watch asks their health.
        addresses = {
            "inference-router": config.router_address,
            "environment-sandbox": config.sandbox_address,
            "reward": config.reward_address,
            "rollout-packer": config.packer_address,
        }
        channels = {name: open_channel(address) for name, address in addresses.items() if address}
        peers = Peers(
            router=router,
            sandbox=environment_pb2_grpc.EnvironmentSandboxServiceStub(channels["environment-sandbox"])
            if "environment-sandbox" in channels
            else None,
            reward=reward_pb2_grpc.RewardServiceStub(channels["reward"]) if "reward" in channels else None,
            health={name: health_pb2_grpc.HealthStub(channel) for name, channel in channels.items()},
        )
        packer = None
        if config.packer_address:
            packer = packer_pb2_grpc.RolloutPackerServiceStub(open_channel(config.packer_address))
        runs = RunManager(
            bus,
            RunStore(await bus.kv(subjects.RUNS)),
            Path(config.recipe_base_dir),
            packer,
            config.recipe_limits,
            peers,
            {tenant.name: tenant for _, tenant in config.tenant_table()},
            ClusterResources(router),
            path_roots=tuple(Path(d) for d in config.model_dirs),
        )
        servicer.runs = runs
        tokenizers = TokenizerCache(config.tokenizer)
        tokenizers.get()  # a default that does not load fails at start-up
        api = HttpApi(runs, auth, router, tokenizers)
        runner = web.AppRunner(api.app(), access_log=None)
        await runner.setup()
        port = config.http_port or free_port()
        await web.TCPSite(runner, config.host, port).start()
        await runs.resume()
        run_gauges = asyncio.create_task(follow_runs(runs.store), name="run-metrics")
        admitting = asyncio.create_task(runs.admit_forever(), name="run-queue")

        async def shutdown() -> None:
            run_gauges.cancel()
            admitting.cancel()
            await runs.close()
            await runner.cleanup()
            await bus.drain()

        svc.on_shutdown(shutdown)

    await service.run(setup)
