"""The router's two-phase request to a disaggregated deployment, against in-process fake workers
(the router, its policy and two_phase.py are the real code; test_replica_disaggregated.py and the
integration tests use real workers): which worker prefills and which decodes, what each is sent,
and that a lost prefill or decode worker costs a retry or a recompute, never the request."""

from __future__ import annotations

import json

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.handles import ReplicaFailure
from services.inference_router.policies import (
    ROLE_DECODE,
    ROLE_PREFILL,
    DeploymentState,
    ReplicaState,
    RoutingPolicy,
)
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.router import Router
from services.inference_router.two_phase import DO_REMOTE_DECODE


class Worker:
    """Answers like a disaggregated deployment's worker: a prefill hands KV params over, a decode
    says whether it continued from them."""

    def __init__(self, name: str, version: int = 0) -> None:
        self.name, self.version = name, version
        self.seen: list[inference_pb2.GenerateRequest] = []
        self.fail = 0

    async def generate(self, request, timeout_s):
        self.seen.append(request)
        if self.fail:
            self.fail -= 1
            raise ReplicaFailure(self.name, "died")
        params = json.loads(request.kv_transfer_params or "{}")
        if params.get("do_remote_decode"):
            kv = {"do_remote_prefill": True, "prefill_replica": self.name, "kv_version": self.version}
            return inference_pb2.GenerateResponse(kv_transfer_params=json.dumps(kv))
        comp = inference_pb2.Completion(
            token_ids=[1] * request.sampling.max_tokens, weight_version=self.version
        )
        handed = params.get("do_remote_prefill", False)
        return inference_pb2.GenerateResponse(
            completions=[comp],
            kv_transfer="shm" if handed else "recompute",
            prefill_replica=params.get("prefill_replica", ""),
        )

    async def status(self, timeout_s):
        return ReplicaStatus(replica=self.name, weight_version=self.version, ready=True, address=self.name)

    async def close(self):
        pass

    @property
    def prefills(self):
        return [r for r in self.seen if json.loads(r.kv_transfer_params or "{}").get("do_remote_decode")]

    @property
    def decodes(self):
        return [r for r in self.seen if not json.loads(r.kv_transfer_params or "{}").get("do_remote_decode")]


async def _router(prefill=2, decode=2, versions=None):
    workers = [Worker(f"pd-r{i}") for i in range(prefill + decode)]
    for w, v in zip(workers, versions or [], strict=False):
        w.version = v
    dep = DeploymentState(name="pd", max_model_len=256, disaggregated=True)
    dep.replicas = [
        ReplicaState(name=w.name, deployment="pd", role=ROLE_PREFILL if i < prefill else ROLE_DECODE)
        for i, w in enumerate(workers)
    ]
    router = Router(RoutingPolicy(), RouterConfig(version_wait_s=0.0))
    router.add_deployment(dep, workers)
    await router.poll_once()
    return router, workers


def _request(**kw):
    sampling = common_pb2.SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=4)
    return inference_pb2.GenerateRequest(prompt_token_ids=[3, 4, 5], sampling=sampling, **kw)


def _handoffs(transfer: str) -> float:
    return metrics.KV_HANDOFFS.labels("pd", transfer)._value.get()


async def test_a_prefill_worker_prefills_and_a_decode_worker_decodes_from_its_kv():
    router, workers = await _router()
    shm_before = _handoffs("shm")
    # A caller's params are never passed on: only the router's exchange sets them.
    response = await router.generate(_request(kv_transfer_params='{"do_remote_prefill": true, "kv_id": "x"}'))
    [prefill] = [p for w in workers[:2] for p in w.prefills]
    assert (prefill.sampling.max_tokens, prefill.sampling.n) == (1, 1)
    assert prefill.kv_transfer_params == DO_REMOTE_DECODE and prefill.sampling.seed == 4
    [decode] = [d for w in workers[2:] for d in w.decodes]
    assert json.loads(decode.kv_transfer_params)["prefill_replica"] in ("pd-r0", "pd-r1")
    assert decode.sampling.max_tokens == 5 and decode.sampling.n == 3  # the caller's sampling
    assert response.replica in ("pd-r2", "pd-r3") and response.kv_transfer == "shm"
    assert not any(w.decodes for w in workers[:2]) and not any(w.prefills for w in workers[2:])
    assert _handoffs("shm") == shm_before + 1


async def test_a_lost_prefill_worker_moves_the_prefill_and_without_any_the_decode_worker_computes_it():
    router, workers = await _router()
    workers[0].fail = workers[1].fail = 1
    recompute_before = _handoffs("recompute")
    response = await router.generate(_request())
    assert len(response.completions[0].token_ids) == 5  # not lost
    assert response.kv_transfer == "recompute" and response.prefill_replica == ""
    assert not router.replicas["pd-r0"].routable and not router.replicas["pd-r1"].routable
    assert _handoffs("recompute") == recompute_before + 1
    router2, workers2 = await _router()
    workers2[0].fail = 1
    workers2[1].fail = 0
    response = await router2.generate(_request())
    assert response.kv_transfer == "shm" and response.prefill_replica in ("pd-r0", "pd-r1")


async def test_a_lost_decode_worker_is_retried_elsewhere_with_a_new_prefill():
    router, workers = await _router(prefill=1, decode=2)
    workers[1].fail = workers[2].fail = 1  # both decode workers fail their first request
    response = await router.generate(_request())
    assert len(response.completions[0].token_ids) == 5
    # Both decode workers failed and are out of routing: the third attempt decodes on the prefill
    # worker, which computes the prompt itself (no other prefill worker is left). Every attempt on
    # a decode worker had its own prefill (the KV went to the worker that failed).
    assert response.replica == "pd-r0" and response.kv_transfer == "recompute"
    assert [len(w.decodes) for w in workers] == [1, 1, 1] and len(workers[0].prefills) == 2


async def test_without_a_live_decode_worker_a_prefill_worker_decodes():
    router, _ = await _router()
    for name in ("pd-r2", "pd-r3"):
        router.replicas[name].healthy = False
    response = await router.generate(_request())
    assert response.replica in ("pd-r0", "pd-r1")
    other = "pd-r1" if response.replica == "pd-r0" else "pd-r0"
    assert response.prefill_replica == other  # the other prefill worker still prefilled for it


async def test_the_prefill_worker_at_the_decode_workers_version_is_preferred():
    # r0 at version 1, r1 at version 0 (a commit reaching the workers one by one); decoders at 0.
    router, _ = await _router(versions=[1, 0, 0, 0])
    for _ in range(4):
        response = await router.generate(_request())
        assert response.prefill_replica == "pd-r1"
