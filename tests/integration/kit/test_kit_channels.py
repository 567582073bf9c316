"""The kit's client channels against a peer that goes away and comes back on the same address, as
a killed and restarted service does."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.kit.local.infra import free_port
from services.kit.rpc.server import open_channel

OUTAGE_S = 20.0  # long enough for gRPC's default backoff to reach ~10 s between attempts


async def serve(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def answers(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        return True
    except grpc.aio.AioRpcError:
        return False


@pytest.mark.slow
async def test_a_channel_reaches_a_restarted_peer_within_two_seconds_after_a_long_outage() -> None:
    port = free_port()
    server = await serve(port)
    channel = open_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        assert await answers(stub)
        await server.stop(None)
        # The caller keeps trying through the outage, as the services' retry loops do: gRPC's
        # default reconnect backoff would by now wait ~10 s between attempts.
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            assert not await answers(stub)
            await asyncio.sleep(0.2)
        server = await serve(port)
        back = time.monotonic()
        while not await answers(stub) and time.monotonic() - back < 15:
            await asyncio.sleep(0.05)
        recovered = time.monotonic() - back
        assert recovered < 2.0, f"the channel answered only {recovered:.1f}s after the peer was back"
    finally:
        await channel.close()
        await server.stop(None)
