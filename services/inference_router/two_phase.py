"""The router's two-phase request to a disaggregated deployment (prefill worker, then decode worker).

The policy places a request on a decode worker (policies.placeable). Before it is sent there, a
prefill worker of the same deployment prefills its prompt: the router sends it a copy with
max_tokens = 1, n = 1 and `kv_transfer_params = {"do_remote_decode": true, ...}` (the params vLLM's
own proxy sends a NixlConnector prefill instance), and passes the `kv_transfer_params` of its
answer, unchanged, in the request to the decode worker (which, on vLLM, are the NixlConnector's
remote block ids; on the CPU engine, where the KV blob waits: replica_kv.py). The same exchange
serves both backends; the router reads nothing inside the params.

Which prefill worker: a routable one of the deployment at the decode worker's weight version (or
the request's minimum, when that is newer), least outstanding tokens first; one at another version
only when none is (its KV would then be recomputed by the decode worker). A prefill worker that
fails is marked as any failed replica is and the next one is tried; when none is left, the decode
worker is sent the request without params and computes the prompt itself, as it does when the KV
it is pointed to cannot be read. Either way the request is not lost. A decode worker that fails is
retried by the router like any replica, with a new prefill (the KV went to the failed worker).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from looprl.inference.v1 import inference_pb2
from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.handles import ReplicaFailure, ReplicaHandle
from services.inference_router.policies import ROLE_PREFILL, DeploymentState, ReplicaState
from services.kit.telemetry.metrics import observe


class Router(Protocol):
    """What of the Router (router.py) a prefill phase uses: its replicas' handles and accounting."""

    config: RouterConfig
    handles: dict[str, ReplicaHandle]

    def _reserve(self, replica: ReplicaState, request: inference_pb2.GenerateRequest) -> int: ...
    def _release(self, replica: ReplicaState, tokens: int) -> None: ...
    def _replica_failed(self, replica: ReplicaState, exc: ReplicaFailure, run_id: str = "") -> None: ...
    async def _unless_unreachable(self, name: str, call: Awaitable[Any]) -> Any: ...


# vLLM's disaggregated-prefill proxy asks a prefill instance exactly this (NixlConnector reads
# do_remote_decode; the rest are filled in by its answer).
DO_REMOTE_DECODE = json.dumps(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
TRANSFERS = ("shm", "grpc", "nixl", "recompute")


def prefill_candidates(
    dep: DeploymentState, decode: ReplicaState, min_version: int, exclude: set[str]
) -> list[ReplicaState]:
    """The deployment's prefill workers that may prefill for `decode`, best first."""
    target = max(decode.weight_version, min_version)
    live = [
        r
        for r in dep.replicas
        if r.role == ROLE_PREFILL
        and r is not decode
        and r.routable
        and r.name not in exclude
        and r.weight_version >= min_version
    ]
    return sorted(
        live, key=lambda r: (r.weight_version != target, r.outstanding_tokens, r.outstanding_requests)
    )


async def with_prefilled_kv(
    router: Router,
    request: inference_pb2.GenerateRequest,
    dep: DeploymentState,
    decode: ReplicaState,
    deadline: float,
    exclude: set[str],
) -> inference_pb2.GenerateRequest:
    """The request for the decode worker: carrying the KV a prefill worker made for it, or as it
    came when no prefill worker could (the decode worker then computes the prompt)."""
    loop = asyncio.get_running_loop()
    prefill = inference_pb2.GenerateRequest()
    prefill.CopyFrom(request)
    prefill.sampling.max_tokens = 1
    prefill.sampling.n = 1
    prefill.version_wait_ms = 0
    prefill.kv_transfer_params = DO_REMOTE_DECODE
    for worker in prefill_candidates(dep, decode, request.min_weight_version, exclude):
        if loop.time() >= deadline:
            break
        reserved = router._reserve(worker, prefill)
        start = time.perf_counter()
        try:
            answer = await router._unless_unreachable(
                worker.name,
                router.handles[worker.name].generate(
                    prefill, min(router.config.request_timeout_s, max(0.01, deadline - loop.time()))
                ),
            )
        except ReplicaFailure as exc:
            router._replica_failed(worker, exc, request.run_id)
            exclude.add(worker.name)
            metrics.RETRIES.labels(dep.name, worker.name).inc()
            continue
        finally:
            router._release(worker, reserved)
        observe(metrics.PREFILL_SECONDS.labels(dep.name), time.perf_counter() - start)
        if not answer.kv_transfer_params:
            break  # a worker that does not hand KV over (not disaggregated): decode computes it
        out = inference_pb2.GenerateRequest()
        out.CopyFrom(request)
        out.kv_transfer_params = answer.kv_transfer_params
        return out
    return request


def count_handoff(dep: DeploymentState, response: inference_pb2.GenerateResponse) -> None:
    transfer = response.kv_transfer or "recompute"
    metrics.KV_HANDOFFS.labels(dep.name, transfer if transfer in TRANSFERS else "recompute").inc()
