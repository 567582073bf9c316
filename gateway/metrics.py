"""Prometheus metrics of the gateway (names: services/kit/telemetry/metrics.py): HTTP and
OpenAI-compatible traffic by route and status, and the runs of the stack by state.

`http_metrics` is the outermost aiohttp middleware, so it sees the status the client gets (after
the error middleware has turned exceptions into OpenAI-shaped answers). `follow_runs` refreshes
the run gauges from the run store every few seconds: the store is the truth every gateway shares.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from gateway.run_store import LAST_EVALUATION_KEY
from gateway.stalls import STALLED_KEY
from services.kit.telemetry.metrics import counter, gauge, histogram, observe

log = logging.getLogger("looprl.gateway.metrics")

RUNS = gauge("looprl_gateway_runs")
RUN_STEP = gauge("looprl_gateway_run_step")
RUN_WEIGHT_VERSION = gauge("looprl_gateway_run_weight_version")
RUN_EVAL_PASS_AT_1 = gauge("looprl_gateway_run_eval_pass_at_1")
RUN_EVAL_MEAN_REWARD = gauge("looprl_gateway_run_eval_mean_reward")
RESAMPLED_GROUPS = counter("looprl_gateway_resampled_groups_total")
HTTP_REQUESTS = counter("looprl_gateway_http_requests_total")
HTTP_SECONDS = histogram("looprl_gateway_http_request_seconds")
OPENAI_REQUESTS = counter("looprl_gateway_openai_requests_total")
OPENAI_TOKENS = counter("looprl_gateway_openai_tokens_total")

# As GetRun shows them: a running run that stopped making progress counts as stalled.
RUN_STATES = ("queued", "pending", "running", "stalled", "stopping", "completed", "failed", "stopped")
# OpenAI-compatible routes, by the endpoint label their metrics carry.
OPENAI_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
OPENAI_OBJECTS = {"text_completion": "completions", "chat.completion": "chat_completions"}

for _state in RUN_STATES:
    RUNS.labels(_state)
for _endpoint in OPENAI_ROUTES.values():
    for _kind in ("prompt", "completion"):
        OPENAI_TOKENS.labels(_endpoint, _kind)


def init_routes(app: web.Application) -> None:
    """Every route's series at zero (as answered with 200), so idle routes show 0, not "No data"."""
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        pattern = route.resource.canonical if route.resource is not None else "unmatched"
        HTTP_REQUESTS.labels(pattern, route.method, "200")
        HTTP_SECONDS.labels(pattern, "200")
        if pattern in OPENAI_ROUTES:
            OPENAI_REQUESTS.labels(OPENAI_ROUTES[pattern], "200")


def _route(request: web.Request) -> str:
    """The route pattern (/v1/runs/{run_id}), not the path: one series per route, not per run."""
    route = request.match_info.route
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def http_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        route = _route(request)
        HTTP_REQUESTS.labels(route, request.method, str(status)).inc()
        observe(HTTP_SECONDS.labels(route, str(status)), time.perf_counter() - started)
        if route in OPENAI_ROUTES:
            OPENAI_REQUESTS.labels(OPENAI_ROUTES[route], str(status)).inc()


def count_openai_tokens(kind: str, usage: dict[str, int]) -> None:
    """The tokens of one answered OpenAI-compatible request (kind: the response's "object")."""
    endpoint = OPENAI_OBJECTS.get(kind, kind)
    OPENAI_TOKENS.labels(endpoint, "prompt").inc(usage["prompt_tokens"])
    OPENAI_TOKENS.labels(endpoint, "completion").inc(usage["completion_tokens"])


def record_runs(records: list[Any]) -> None:
    """Set the run gauges from the run records (every state present, at zero when none)."""
    counts = dict.fromkeys(RUN_STATES, 0)
    for record in records:
        state = "stalled" if record.state == "running" and record.extra.get(STALLED_KEY) else record.state
        counts[state] = counts.get(state, 0) + 1
        RUN_STEP.labels(record.run_id).set(record.step)
        RUN_WEIGHT_VERSION.labels(record.run_id).set(record.weight_version)
        latest = record.extra.get(LAST_EVALUATION_KEY)
        if latest:
            RUN_EVAL_PASS_AT_1.labels(record.run_id).set(latest["pass_at_1"])
            RUN_EVAL_MEAN_REWARD.labels(record.run_id).set(latest["mean_reward"])
    for state, count in counts.items():
        RUNS.labels(state).set(count)


async def follow_runs(store: Any, every_s: float = 2.0) -> None:
    """Refresh the run gauges from the store until cancelled."""
    while True:
        try:
            record_runs(await store.list())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # metrics must not take the gateway down
            log.warning("run metrics not refreshed: %s", exc)
        await asyncio.sleep(every_s)
