"""Generate, as the router and every engine answer it (they share GenerateRequest/GenerateResponse):
what a completion must hold, and the refusals of each out-of-range field. Shared by the
inference-router and inference-engine contracts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from conformance.case import Contract, check
from conformance.target import Session
from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2 as pb

FINISH_REASONS = ("stop", "length")


def request(
    prompt: list[int],
    *,
    n: int = 2,
    max_tokens: int = 6,
    temperature: float = 1.0,
    seed: int = 11,
    stop: tuple[int, ...] = (),
    min_weight_version: int = 0,
    deployment: str = "",
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed, n=n, stop_token_ids=list(stop)
        ),
        min_weight_version=min_weight_version,
        deployment=deployment,
        request_id="conformance",
    )


def check_completions(req: pb.GenerateRequest, reply: pb.GenerateResponse, where: str = "Generate") -> None:
    """Every promise of Completion and GenerateResponse about one answer to `req`."""
    s = req.sampling
    check(len(reply.completions) == max(s.n, 1), f"{where}: {len(reply.completions)} completions for n={s.n}")
    check(
        reply.prompt_tokens == len(req.prompt_token_ids),
        f"{where}: prompt_tokens {reply.prompt_tokens} for a {len(req.prompt_token_ids)}-token prompt",
    )
    for i, c in enumerate(reply.completions):
        at = f"{where}: completions[{i}]"
        check(
            0 < len(c.token_ids) <= s.max_tokens,
            f"{at}: {len(c.token_ids)} tokens for max_tokens {s.max_tokens}",
        )
        check(
            len(c.logprobs) == len(c.token_ids),
            f"{at}: {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens",
        )
        check(
            all(math.isfinite(lp) and lp <= 1e-5 for lp in c.logprobs), f"{at}: log-probs {list(c.logprobs)}"
        )
        check(c.finish_reason in FINISH_REASONS, f"{at}: finish_reason {c.finish_reason!r}")
        stops = set(s.stop_token_ids)
        if c.finish_reason == "stop":
            check(c.token_ids[-1] in stops, f"{at}: finished 'stop' without ending on a stop token")
        else:
            check(
                len(c.token_ids) == s.max_tokens,
                f"{at}: finished 'length' after {len(c.token_ids)} of {s.max_tokens} tokens",
            )
        check(not stops.intersection(c.token_ids[:-1]), f"{at}: generation went on after a stop token")
        check(
            c.weight_version >= req.min_weight_version,
            f"{at}: weight_version {c.weight_version} < min_weight_version {req.min_weight_version}",
        )


def add_invalid_field_cases(
    contract: Contract,
    valid: Callable[[Session], pb.GenerateRequest],
    call: Callable[[Session, pb.GenerateRequest], object],
    needs: Callable[[Session], None],
    max_model_len: Callable[[Session], int],
) -> None:
    """One case per out-of-range value of GenerateRequest that must be refused naming its field.
    `valid(s)` is a request the service would serve; `needs(s)` skips when it cannot serve yet."""

    def case(
        name: str,
        field: str,
        change: Callable[[pb.GenerateRequest, Session], None],
        proto: str,
        quote: str,
        what: str = "",
    ) -> None:
        def run(s: Session) -> None:
            needs(s)
            req = valid(s)
            change(req, s)
            s.refused("INVALID_ARGUMENT", lambda: call(s, req), naming=field)

        behaviour = f"{what or field + ' out of range'} is refused naming {field}"
        contract.add(f"generate.invalid.{name}", "Generate", behaviour, "INVALID_ARGUMENT", proto, quote, run)

    def vocab(s: Session) -> int:
        return s.need("vocab_size", "the model's vocabulary is not known")

    def too_long(r: pb.GenerateRequest, s: Session) -> None:
        r.sampling.max_tokens = max_model_len(s)

    ids = "looprl.inference.v1.GenerateRequest.prompt_token_ids"
    case(
        "prompt_empty",
        "prompt_token_ids",
        lambda r, s: r.ClearField("prompt_token_ids"),
        ids,
        "must be non-empty",
        "an empty prompt",
    )
    case(
        "prompt_vocabulary",
        "prompt_token_ids",
        lambda r, s: r.prompt_token_ids.append(vocab(s)),
        ids,
        "inside the vocabulary",
        "a prompt token outside the vocabulary",
    )
    case(
        "temperature",
        "sampling.temperature",
        lambda r, s: setattr(r.sampling, "temperature", -1.0),
        "looprl.common.v1.SamplingParams.temperature",
        "Must be >= 0",
    )
    case(
        "top_p",
        "sampling.top_p",
        lambda r, s: setattr(r.sampling, "top_p", 1.5),
        "looprl.common.v1.SamplingParams.top_p",
        "in (0, 1]",
    )
    case(
        "top_k",
        "sampling.top_k",
        lambda r, s: setattr(r.sampling, "top_k", -1),
        "looprl.common.v1.SamplingParams.top_k",
        "negative: INVALID_ARGUMENT",
    )
    case(
        "max_tokens",
        "sampling.max_tokens",
        lambda r, s: setattr(r.sampling, "max_tokens", 0),
        "looprl.common.v1.SamplingParams.max_tokens",
        "must be > 0",
    )
    case(
        "model_length",
        "sampling.max_tokens",
        too_long,
        "looprl.common.v1.SamplingParams.max_tokens",
        "the prompt plus max_tokens must fit the model length",
        "a prompt plus max_tokens beyond the model length",
    )
    case(
        "stop_token_ids",
        "sampling.stop_token_ids",
        lambda r, s: r.sampling.stop_token_ids.append(vocab(s) + 3),
        "looprl.common.v1.SamplingParams.stop_token_ids",
        "inside the vocabulary",
    )
