"""The inference-router contract (looprl.inference.v1.InferenceRouterService): completions as the
engine contract defines them, never from weights older than asked for, streams that reassemble into
the same completions and survive a cancelled caller, and refusals naming the field.

Generation needs a deployment whose replicas serve weights (`--option deployment=NAME`, else the
first such deployment ListDeployments shows); without one those cases are skipped. The model's
vocabulary size, for the vocabulary refusals, is `--option vocab_size` (default: that of
`--option model_config`, looprl's tiny preset by default). RegisterDeployment is checked only for
its refusals: a registered deployment cannot be removed again.
"""

from __future__ import annotations

import time

import grpc

from conformance import generation
from conformance.case import Contract, check, skip
from conformance.common import add_common, health
from conformance.target import Session
from conformance.weights import Model
from looprl.inference.v1 import inference_pb2 as pb

SERVICE = "looprl.inference.v1.InferenceRouterService"
contract = Contract(
    "inference-router",
    SERVICE,
    "routes generation across deployments: Generate, GenerateStream, ListDeployments, RegisterDeployment",
    options={
        "deployment": "deployment to generate with (default: the first whose replicas serve weights)",
        "vocab_size": "the served model's vocabulary size (default: that of model_config)",
        "model_config": "a Hugging Face config.json of the served model (default: looprl's tiny preset)",
    },
)
add_common(contract, "ListDeployments", pb.ListDeploymentsRequest())

LAYOUTS = ("hf", "fused")
MAX_N = 256


def _deployments(s: Session) -> pb.ListDeploymentsResponse:
    return s.unary("ListDeployments", pb.ListDeploymentsRequest(), pb.ListDeploymentsResponse)


def _choose(s: Session) -> None:
    """The deployment to generate with, its replicas' version and the vocabulary, once."""
    if "listed" in s.facts:
        return
    listed = _deployments(s).deployments
    s.facts["listed"] = listed
    chosen = s.option("deployment")
    candidates = [
        d
        for d in listed
        if (d.name == chosen if chosen else any(r.healthy and r.weight_version >= 0 for r in d.replicas))
    ]
    if chosen and not candidates:
        check(False, f"no deployment {chosen!r} (lists {[d.name for d in listed]})")
    vocab = s.option("vocab_size")
    s.facts["vocab_size"] = (
        int(vocab) if vocab else Model.from_option(s.option("model_config")).config.vocab_size
    )
    if candidates:
        s.facts["deployment"] = candidates[0]
        s.facts["version"] = min(r.weight_version for r in candidates[0].replicas if r.healthy)


def _serving(s: Session) -> pb.DeploymentInfo:
    _choose(s)
    return s.need("deployment", "no deployment's replicas serve weights (ListDeployments)")


def _prompt(s: Session) -> list[int]:
    vocab = s.facts["vocab_size"]
    return [(5 * i + 2) % vocab for i in range(4)]


def _generate(s: Session, req: pb.GenerateRequest, timeout: float | None = None) -> pb.GenerateResponse:
    return s.unary("Generate", req, pb.GenerateResponse, timeout=timeout)


def _request(s: Session, **kw) -> pb.GenerateRequest:
    return generation.request(_prompt(s), deployment=_serving(s).name, **kw)


@contract.case(
    "list.shape",
    "ListDeployments",
    "lists deployments with unique names, each with its replicas, profile, layout and model length",
    "OK",
    "looprl.inference.v1.DeploymentInfo.layout",
    '"hf" (unfused names) or "fused"',
)
def _list(s: Session) -> None:
    reply = _deployments(s)
    names = [d.name for d in reply.deployments]
    check(len(set(names)) == len(names) and all(names), f"deployment names {names}")
    for d in reply.deployments:
        replicas = [r.name for r in d.replicas]
        check(d.replicas and len(set(replicas)) == len(replicas), f"{d.name}: replicas {replicas}")
        check(d.layout in LAYOUTS, f"{d.name}: layout {d.layout!r}")
        check(d.max_model_len > 0, f"{d.name}: max_model_len {d.max_model_len}")
        p = d.profile
        for lo, hi, what in (
            (p.min_prompt_tokens, p.max_prompt_tokens, "prompt"),
            (p.min_output_tokens, p.max_output_tokens, "output"),
        ):
            check(lo >= 0 and (hi == 0 or hi >= lo), f"{d.name}: {what} tokens profile [{lo}, {hi}]")


@contract.case(
    "generate.completions",
    "Generate",
    "answers n completions with a log-prob per token and the version they were sampled under, naming the deployment and replica",
    "OK",
    "looprl.inference.v1.GenerateResponse.replica",
    "The replica that served the request",
)
def _completions(s: Session) -> None:
    dep = _serving(s)
    req = _request(s, n=3, max_tokens=5, min_weight_version=s.facts["version"])
    reply = _generate(s, req)
    generation.check_completions(req, reply)
    check(reply.deployment == dep.name, f"served by deployment {reply.deployment!r}, pinned {dep.name!r}")
    check(
        reply.replica in {r.name for r in dep.replicas},
        f"replica {reply.replica!r} is not one of {dep.name}'s",
    )


@contract.case(
    "generate.seeded",
    "Generate",
    "the same prompt, seed and weights give the same tokens",
    "OK",
    "looprl.common.v1.SamplingParams.seed",
    "same tokens",
)
def _seeded(s: Session) -> None:
    req = _request(s, n=2, max_tokens=5, seed=99)
    first, again = _generate(s, req), _generate(s, req)
    if {c.weight_version for c in first.completions} != {c.weight_version for c in again.completions}:
        skip("the weights changed between the two requests")
    check(
        [list(c.token_ids) for c in first.completions] == [list(c.token_ids) for c in again.completions],
        "the same seeded request sampled different tokens",
    )


@contract.case(
    "generate.min_weight_version",
    "Generate",
    "a request for a version no replica serves is never answered from older weights",
    "DEADLINE_EXCEEDED",
    "looprl.inference.v1.GenerateRequest.min_weight_version",
    "never from older weights",
)
def _min_version(s: Session) -> None:
    _serving(s)
    wanted = s.facts["version"] + 1000
    req = _request(s, n=1, max_tokens=2, min_weight_version=wanted)
    s.refused(
        ("DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "UNAVAILABLE"), lambda: _generate(s, req, timeout=3.0)
    )


@contract.case(
    "generate_stream.reassembles",
    "GenerateStream",
    "streams each completion's tokens in order, its last chunk carrying the finish reason",
    "OK",
    "looprl.inference.v1.GenerateStreamResponse.finish_reason",
    "Set on the last chunk of a completion",
)
def _stream(s: Session) -> None:
    req = _request(s, n=2, max_tokens=6, min_weight_version=s.facts.get("version", 0))
    chunks = list(
        s.unary_stream("GenerateStream", pb.GenerateStreamRequest(request=req), pb.GenerateStreamResponse)
    )
    done: dict[int, pb.Completion] = {}
    building: dict[int, pb.Completion] = {}
    for chunk in chunks:
        check(0 <= chunk.index < 2, f"chunk index {chunk.index} for n=2")
        check(chunk.index not in done, f"a chunk of completion {chunk.index} after its finish reason")
        check(
            len(chunk.logprobs) == len(chunk.token_ids),
            f"chunk of {len(chunk.token_ids)} tokens with {len(chunk.logprobs)} log-probs",
        )
        c = building.setdefault(chunk.index, pb.Completion(weight_version=chunk.weight_version))
        c.token_ids.extend(chunk.token_ids)
        c.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            c.finish_reason = chunk.finish_reason
            done[chunk.index] = building.pop(chunk.index)
    check(
        not building and len(done) == 2,
        f"completions finished: {sorted(done)}, unfinished: {sorted(building)}",
    )
    reply = pb.GenerateResponse(
        completions=[done[i] for i in range(2)], prompt_tokens=len(req.prompt_token_ids)
    )
    generation.check_completions(req, reply, "GenerateStream")


@contract.case(
    "generate_stream.cancelled",
    "GenerateStream",
    "a caller that cancels a stream leaves the router serving",
    "CANCELLED",
    "looprl.inference.v1.InferenceRouterService.GenerateStream",
    "A cancelled stream stops generating",
)
def _cancel(s: Session) -> None:
    dep = _serving(s)
    req = _request(s, n=1, max_tokens=max(1, dep.max_model_len - 8), temperature=1.0)
    call = s.unary_stream(
        "GenerateStream", pb.GenerateStreamRequest(request=req), pb.GenerateStreamResponse, timeout=60
    )
    try:
        next(iter(call))
    except StopIteration:
        pass
    call.cancel()
    check(call.code() == grpc.StatusCode.CANCELLED or call.done(), "the stream did not end on cancel")
    time.sleep(0.2)
    check(health(s) == "SERVING", "the router stopped serving after a cancelled stream")
    small = _request(s, n=1, max_tokens=2)
    generation.check_completions(small, _generate(s, small))


def _valid(s: Session) -> pb.GenerateRequest:
    return _request(s, n=1, max_tokens=4)


generation.add_invalid_field_cases(contract, _valid, _generate, _serving, lambda s: _serving(s).max_model_len)


def _router_field(name: str, field: str, change, proto: str, quote: str) -> None:
    def run(s: Session) -> None:
        req = generation.request([1, 2, 3], n=1, max_tokens=2)
        change(req)
        s.refused("INVALID_ARGUMENT", lambda: _generate(s, req), naming=field)

    contract.add(
        f"generate.invalid.{name}",
        "Generate",
        f"{field} out of range is refused naming it",
        "INVALID_ARGUMENT",
        proto,
        quote,
        run,
    )


_router_field(
    "n",
    "sampling.n",
    lambda r: setattr(r.sampling, "n", MAX_N + 1),
    "looprl.common.v1.SamplingParams.n",
    "at most 256",
)
_router_field(
    "min_weight_version",
    "min_weight_version",
    lambda r: setattr(r, "min_weight_version", -1),
    "looprl.inference.v1.GenerateRequest.min_weight_version",
    "negative: INVALID_ARGUMENT",
)
_router_field(
    "expected_output_tokens",
    "expected_output_tokens",
    lambda r: setattr(r, "expected_output_tokens", -1),
    "looprl.inference.v1.GenerateRequest.expected_output_tokens",
    "negative: INVALID_ARGUMENT",
)
_router_field(
    "deployment",
    "deployment",
    lambda r: setattr(r, "deployment", "conformance-no-such-deployment"),
    "looprl.inference.v1.GenerateRequest.deployment",
    "unknown: INVALID_ARGUMENT",
)


def _register_case(name: str, field: str, code: str, change, quote: str) -> None:
    def run(s: Session) -> None:
        info = pb.DeploymentInfo(
            name="conformance-never-registered",
            max_model_len=64,
            replicas=[pb.ReplicaInfo(name="r0", address="127.0.0.1:1")],
        )
        change(info, s)
        request = pb.RegisterDeploymentRequest(deployment=info)
        s.refused(
            code, lambda: s.unary("RegisterDeployment", request, pb.RegisterDeploymentResponse), naming=field
        )

    contract.add(
        f"register.{name}",
        "RegisterDeployment",
        f"a deployment with {field} wrong is refused naming it",
        code,
        "looprl.inference.v1.RegisterDeploymentRequest.deployment",
        quote,
        run,
    )


def _existing(info: pb.DeploymentInfo, s: Session) -> None:
    listed = _deployments(s).deployments
    if not listed:
        skip("the router has no deployment whose name could be taken twice")
    info.name = listed[0].name


_register_case(
    "name", "deployment.name", "INVALID_ARGUMENT", lambda i, s: setattr(i, "name", ""), "name empty"
)
_register_case(
    "replicas",
    "deployment.replicas",
    "INVALID_ARGUMENT",
    lambda i, s: i.ClearField("replicas"),
    "a replica without an address",
)
_register_case(
    "max_model_len",
    "deployment.max_model_len",
    "INVALID_ARGUMENT",
    lambda i, s: setattr(i, "max_model_len", 0),
    "max_model_len not > 0",
)
_register_case(
    "taken", "deployment.name", "ALREADY_EXISTS", _existing, "a name already served: ALREADY_EXISTS"
)
