"""Wires the gateway process: bus, run manager, gRPC service, HTTP API."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gateway.auth import TokenAuth
from gateway.config import GatewayConfig
from gateway.http import HttpApi
from gateway.runs import RunStore
from gateway.service import GatewayServicer, RunManager
from looprl.gateway.v1 import gateway_pb2_grpc
from looprl.inference.v1 import inference_pb2_grpc
from looprl.packer.v1 import packer_pb2_grpc
from services.kit import subjects
from services.kit.bus import Bus
from services.kit.local import free_port
from services.kit.server import Service, open_channel
from services.modeling.tokenizer import TokenizerCache


async def serve(config: GatewayConfig) -> None:
    service = Service("gateway", config, public=True)
    auth = TokenAuth.from_config(config.tokens)
    # Servicer first (handlers must be registered before the port opens); its run manager needs
    # the bus, connected in setup. The kit refuses RPCs with UNAVAILABLE until setup finished.
    servicer = GatewayServicer(None, auth)  # type: ignore[arg-type]
    service.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer)

    async def setup(svc: Service) -> None:
        bus = await Bus.connect(config.nats_url, name="gateway")
        await bus.ensure_streams()
        packer = None
        if config.packer_address:
            packer = packer_pb2_grpc.RolloutPackerServiceStub(open_channel(config.packer_address))
        runs = RunManager(
            bus,
            RunStore(await bus.kv(subjects.RUNS)),
            Path(config.recipe_base_dir),
            packer,
            config.exclusive_runs,
            config.limits(),
        )
        servicer.runs = runs
        router = None
        if config.router_address:
            router = inference_pb2_grpc.InferenceRouterServiceStub(open_channel(config.router_address))
        tokenizers = TokenizerCache(config.tokenizer)
        tokenizers.get()  # a default that does not load fails at start-up
        api = HttpApi(runs, auth, router, tokenizers)
        runner = web.AppRunner(api.app(), access_log=None)
        await runner.setup()
        port = config.http_port or free_port()
        await web.TCPSite(runner, config.host, port).start()
        await runs.resume()

        async def shutdown() -> None:
            await runs.close()
            await runner.cleanup()
            await bus.drain()

        svc.on_shutdown(shutdown)

    await service.run(setup)
