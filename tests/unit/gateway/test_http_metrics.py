"""The gateway's HTTP metrics: requests counted by route pattern (not path) and the status the
client got, every route's series present at zero from the start."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, generate_latest

from gateway.auth import TokenAuth
from gateway.http import HttpApi


def test_gateway_counts_http_requests_by_route_pattern_and_status():
    api = HttpApi(None, TokenAuth(["secret"]), None, None)  # type: ignore[arg-type]

    def count(route: str, status: str) -> float:
        for line in generate_latest(REGISTRY).decode().splitlines():
            if line.startswith("looprl_gateway_http_requests_total{") and (
                f'route="{route}"' in line and f'status="{status}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    app = api.app()

    async def drive() -> None:
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/healthz")).status == 200
            assert (await client.get("/v1/runs/some-run")).status == 401
            assert (await client.get("/v1/runs/other-run")).status == 401

    before = count("/v1/runs/{run_id}", "401"), count("/healthz", "200")
    asyncio.run(drive())
    assert count("/v1/runs/{run_id}", "401") == max(before[0], 0) + 2  # one series for all run ids
    assert count("/healthz", "200") == before[1] + 1
    assert count("/v1/completions", "200") >= 0, "routes start at zero"
