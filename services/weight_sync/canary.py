"""Canary check: does a new version still answer fixed prompts the way the previous one did?

A deployment registered with `canary` gets every new version staged on all its replicas as
usual, but only ONE replica (the first) commits it at first. Weight-sync runs the golden prompts
(fixed token ids) through that replica's Generate, greedily, right before its commit and right
after, and compares the log-probs of the greedy tokens:

    drift = mean over golden prompts and positions of |logprob_after - logprob_before|

counting, per prompt, positions up to and including the first where the greedy tokens differ
(up to there both versions saw the same context, so their log-probs are comparable; beyond it
they are not). A non-finite log-prob, or an error from the new version, is infinite drift.
Within `max_logprob_drift` the rest of the deployment commits; otherwise the canary replica
rolls back to the version it served before (RollbackWeights: the replica still holds it, see
WeightStager.rollback), the other replicas drop what they staged, and the target records the
rejection. A real training step moves greedy log-probs by far less than a nat; weights that
pass every checksum but are wrong (a bad trainer step, a scale or layout bug) move them by
several. Checksums catch bytes broken in transit; the canary catches bytes that were wrong
before they left.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("looprl.weight_sync.canary")

Answer = tuple[list[int], list[float]]  # greedy tokens and their log-probs


@dataclass
class CanaryVerdict:
    passed: bool
    drift: float
    compared: int  # positions compared
    detail: str = ""


def default_prompts(
    vocab_size: int, count: int = 4, length: int = 8, seed: int = 20240611
) -> list[list[int]]:
    """Fixed prompts from a fixed seed: the same for every version and every weight-sync process."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


async def golden_answers(
    stub: inference_pb2_grpc.InferenceEngineServiceStub,
    prompts: Sequence[Sequence[int]],
    tokens: int,
    *,
    tag: str = "canary",
    timeout_s: float = 60.0,
) -> list[Answer]:
    """Greedy completions of every prompt (log-probs at temperature 1, the engine contract)."""

    async def one(i: int, prompt: Sequence[int]) -> Answer:
        resp = await stub.Generate(
            inference_pb2.GenerateRequest(
                prompt_token_ids=list(prompt),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens, n=1),
                request_id=f"{tag}-{i}",
            ),
            timeout=timeout_s,
        )
        completion = resp.completions[0]
        return list(completion.token_ids), list(completion.logprobs)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def logprob_drift(before: Sequence[Answer], after: Sequence[Answer]) -> tuple[float, int]:
    """(mean |delta log-prob| over comparable positions, positions compared); see module doc."""
    total, count = 0.0, 0
    for (tokens_b, lps_b), (tokens_a, lps_a) in zip(before, after, strict=True):
        if any(not math.isfinite(x) for x in lps_a):
            return math.inf, count
        if tokens_b and not tokens_a:
            return math.inf, count
        for i in range(min(len(tokens_b), len(tokens_a))):
            total += abs(lps_a[i] - lps_b[i])
            count += 1
            if tokens_a[i] != tokens_b[i]:
                break  # later positions see different contexts
    return (total / count if count else 0.0), count


async def check(
    stub: inference_pb2_grpc.InferenceEngineServiceStub,
    before: Sequence[Answer],
    prompts: Sequence[Sequence[int]],
    tokens: int,
    max_drift: float,
    *,
    tag: str,
) -> CanaryVerdict:
    """Answers of the committed canary against `before`."""
    try:
        after = await golden_answers(stub, prompts, tokens, tag=tag)
    except grpc.aio.AioRpcError as exc:
        return CanaryVerdict(
            False,
            math.inf,
            0,
            f"the new version failed the golden prompts: {exc.code().name}: {exc.details()}",
        )
    drift, compared = logprob_drift(before, after)
    passed = drift <= max_drift
    detail = f"log-prob drift {drift:.4g} over {compared} positions (bound {max_drift:g})"
    return CanaryVerdict(passed, drift, compared, detail)


async def rollback(stub: inference_pb2_grpc.InferenceEngineServiceStub, ep: object, version: int) -> str:
    """Roll a rejected version back on one rank: "" when it did, else why not (it still serves it)."""
    try:
        request = inference_pb2.RollbackWeightsRequest(version=version, adapter=getattr(ep, "adapter", ""))
        await stub.RollbackWeights(request, timeout=60)
    except grpc.aio.AioRpcError as exc:
        log.error(
            "%s: rollback of rejected version %s failed (%s: %s); it still serves it",
            ep,
            version,
            exc.code().name,
            exc.details(),
        )
        return f"{ep}: {exc.code().name}: {exc.details()}"
    return ""
