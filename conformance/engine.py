"""The inference-engine contract (looprl.inference.v1.InferenceEngineService): what a deployment's
replica must do for the router and for weight-sync. Weights are staged beside the serving version,
verified slice by slice (a checksum mismatch is DATA_LOSS and that version can never be committed),
switched atomically on commit, aborted or rolled back on request; generation carries the version
it sampled under.

The kit stages and commits versions of its own (seeded random weights of `--option model_config`,
looprl's tiny preset by default, numbered after the version the engine serves): run it against an
engine that serves no run.
"""

from __future__ import annotations

import time

from conformance import generation
from conformance.case import Contract, check, skip
from conformance.common import add_common
from conformance.target import Session
from conformance.weights import Model, stage_requests
from looprl.inference.v1 import inference_pb2 as pb

SERVICE = "looprl.inference.v1.InferenceEngineService"
contract = Contract(
    "inference-engine",
    SERVICE,
    "one replica of a deployment: Generate, Status, Pause/Resume and the weight lifecycle",
    options={
        "model_config": "a Hugging Face config.json of the model the engine serves (default: looprl's tiny preset)",
        "max_model_len": "the engine's model length, for the length refusal (default: skipped)",
    },
)
add_common(contract, "Status", pb.StatusRequest())

STAGE = "looprl.inference.v1.InferenceEngineService.StageWeights"
COMMIT = "looprl.inference.v1.InferenceEngineService.CommitWeights"


def _model(s: Session) -> Model:
    if "model" not in s.facts:
        s.facts["model"] = Model.from_option(s.option("model_config"))
        s.facts["vocab_size"] = s.facts["model"].config.vocab_size
    return s.facts["model"]


def _status(s: Session) -> pb.StatusResponse:
    return s.unary("Status", pb.StatusRequest(), pb.StatusResponse)


def _next_version(s: Session) -> int:
    """A version newer than anything the engine served or staged (every stage uses a fresh one)."""
    if "next_version" not in s.facts:
        st = _status(s)
        s.facts["next_version"] = max(st.weight_version, st.staged_version, -1) + 1
    version = s.facts["next_version"]
    s.facts["next_version"] = version + 1
    return version


def _stage(s: Session, requests: list[pb.StageWeightsRequest]) -> pb.StageWeightsResponse:
    return s.stream_unary("StageWeights", requests, pb.StageWeightsResponse)


def _serving(s: Session) -> int:
    return s.need("version", "no version was committed (inference-engine.commit.serves failed)")


def _generate(s: Session, req: pb.GenerateRequest, timeout: float | None = None) -> pb.GenerateResponse:
    return s.unary("Generate", req, pb.GenerateResponse, timeout=timeout)


def _prompt(s: Session) -> list[int]:
    vocab = _model(s).config.vocab_size
    return [(7 * i + 3) % vocab for i in range(5)]


@contract.case(
    "status.shape",
    "Status",
    "reports the version served (-1 without weights), the staged one and its load",
    "OK",
    "looprl.inference.v1.StatusResponse.weight_version",
    "-1 while it holds no weights",
)
def _status_shape(s: Session) -> None:
    st = _status(s)
    check(
        st.weight_version >= -1 and st.staged_version >= -1,
        f"weight_version {st.weight_version}, staged_version {st.staged_version}",
    )
    check(0.0 <= st.cache_usage <= 1.0, f"cache_usage {st.cache_usage}")
    check(
        st.queued_requests >= 0 and st.tokens_in_flight >= 0,
        f"queued_requests {st.queued_requests}, tokens_in_flight {st.tokens_in_flight}",
    )
    s.facts["start_version"] = st.weight_version
    s.facts["next_version"] = max(st.weight_version, st.staged_version, -1) + 1
    _model(s)


@contract.case(
    "generate.without_weights",
    "Generate",
    "an engine that holds no weights refuses to generate",
    "UNAVAILABLE",
    "looprl.inference.v1.InferenceEngineService.Generate",
    "UNAVAILABLE while the engine holds no weights",
)
def _no_weights(s: Session) -> None:
    if s.need("start_version", "Status did not answer (inference-engine.status.shape)") >= 0:
        skip("the engine already serves weights")
    s.refused("UNAVAILABLE", lambda: _generate(s, generation.request(_prompt(s))))


@contract.case(
    "stage.empty_stream",
    "StageWeights",
    "a stream without a bucket is refused",
    "INVALID_ARGUMENT",
    STAGE,
    "A stream without a bucket: INVALID_ARGUMENT",
)
def _empty(s: Session) -> None:
    s.refused("INVALID_ARGUMENT", lambda: _stage(s, []))


@contract.case(
    "stage.checksum_required",
    "StageWeights",
    "a slice carrying neither hash64 nor sum64 is refused",
    "INVALID_ARGUMENT",
    "looprl.inference.v1.WeightSlice.hash64",
    "A slice carries hash64 or sum64",
)
def _no_checksum(s: Session) -> None:
    requests = stage_requests(_model(s), _next_version(s), checksums=False)
    s.refused("INVALID_ARGUMENT", lambda: _stage(s, requests))


@contract.case(
    "stage.checksum_mismatch",
    "StageWeights",
    "a slice whose bytes do not match its hash64 is refused, and that version can never be committed",
    "DATA_LOSS",
    STAGE,
    "DATA_LOSS, and that version is never committed",
)
def _mismatch(s: Session) -> None:
    version = _next_version(s)
    before = _status(s).weight_version
    s.refused("DATA_LOSS", lambda: _stage(s, stage_requests(_model(s), version, corrupt=True)))
    s.refused(
        ("FAILED_PRECONDITION",),
        lambda: s.unary("CommitWeights", pb.CommitWeightsRequest(version=version), pb.CommitWeightsResponse),
    )
    after = _status(s).weight_version
    check(
        after == before, f"serves version {after} after a corrupt version {version} (served {before} before)"
    )


@contract.case(
    "stage.other_rank",
    "StageWeights",
    "a bucket for a rank the engine does not hold is refused naming `rank`",
    "INVALID_ARGUMENT",
    "looprl.inference.v1.StageWeightsRequest.rank",
    "a replica rejects buckets for another rank",
)
def _other_rank(s: Session) -> None:
    requests = stage_requests(_model(s), _next_version(s), rank=7)
    s.refused("INVALID_ARGUMENT", lambda: _stage(s, requests), naming="rank")


@contract.case(
    "stage.unknown_parameter",
    "StageWeights",
    "a slice of a parameter the model does not have is refused",
    "INVALID_ARGUMENT",
    "looprl.inference.v1.StageWeightsRequest.slices",
    "a name or shape the receiver does not hold: INVALID_ARGUMENT",
)
def _unknown_param(s: Session) -> None:
    requests = stage_requests(_model(s), _next_version(s))
    requests[0].slices[0].name = "model.conformance_no_such_parameter.weight"
    s.refused("INVALID_ARGUMENT", lambda: _stage(s, requests))


@contract.case(
    "stage.not_served_before_commit",
    "StageWeights",
    "a completely staged version is reported complete and staged, and is not served before CommitWeights",
    "OK",
    STAGE,
    "nothing serves them until CommitWeights",
)
def _staged(s: Session) -> None:
    version = _next_version(s)
    before = _status(s).weight_version
    reply = _stage(s, stage_requests(_model(s), version))
    check(
        reply.version == version and reply.complete,
        f"StageWeights answered version {reply.version}, complete={reply.complete}",
    )
    check(
        reply.serving_version == before,
        f"serving_version {reply.serving_version} right after staging (served {before})",
    )
    st = _status(s)
    check(st.staged_version == version, f"Status.staged_version {st.staged_version}, staged {version}")
    check(
        st.weight_version == before,
        f"Status.weight_version {st.weight_version} before the commit (served {before})",
    )
    s.facts["staged"] = version


@contract.case(
    "commit.serves",
    "CommitWeights",
    "commits the staged version: Status and every completion carry it from then on",
    "OK",
    COMMIT,
    "Switch to a fully staged and verified version",
)
def _commit(s: Session) -> None:
    version = s.need("staged", "no version was staged (inference-engine.stage.not_served_before_commit)")
    reply = s.unary("CommitWeights", pb.CommitWeightsRequest(version=version), pb.CommitWeightsResponse)
    check(
        reply.weight_version == version,
        f"CommitWeights answered weight_version {reply.weight_version}, committed {version}",
    )
    check(_status(s).weight_version == version, f"Status.weight_version is not {version} after its commit")
    s.facts["version"] = version


@contract.case(
    "commit.retry",
    "CommitWeights",
    "committing the version already served again answers it (a retried commit)",
    "OK",
    "looprl.inference.v1.CommitWeightsRequest.version",
    "the version served already: answered as a success",
)
def _commit_again(s: Session) -> None:
    version = _serving(s)
    reply = s.unary("CommitWeights", pb.CommitWeightsRequest(version=version), pb.CommitWeightsResponse)
    check(reply.weight_version == version, f"a retried commit answered {reply.weight_version}")


@contract.case(
    "commit.not_staged",
    "CommitWeights",
    "committing a version that is not completely staged is refused naming `version`",
    "FAILED_PRECONDITION",
    "looprl.inference.v1.CommitWeightsRequest.version",
    "not completely staged: FAILED_PRECONDITION",
)
def _commit_missing(s: Session) -> None:
    version = _serving(s) + 1000
    s.refused(
        "FAILED_PRECONDITION",
        lambda: s.unary("CommitWeights", pb.CommitWeightsRequest(version=version), pb.CommitWeightsResponse),
        naming="version",
    )


@contract.case(
    "stage.stale_version",
    "StageWeights",
    "staging a version not newer than the one served is refused naming `version`",
    "FAILED_PRECONDITION",
    "looprl.inference.v1.StageWeightsRequest.version",
    "not newer than the version served or staged: FAILED_PRECONDITION",
)
def _stale(s: Session) -> None:
    version = _serving(s)
    s.refused("FAILED_PRECONDITION", lambda: _stage(s, stage_requests(_model(s), version)), naming="version")


@contract.case(
    "generate.completions",
    "Generate",
    "answers n completions with a log-prob per token, a finish reason, and the version they were sampled under",
    "OK",
    "looprl.inference.v1.Completion.logprobs",
    "Log-prob of each sampled token",
)
def _completions(s: Session) -> None:
    version = _serving(s)
    req = generation.request(_prompt(s), n=3, max_tokens=5)
    reply = _generate(s, req)
    generation.check_completions(req, reply)
    for c in reply.completions:
        check(
            c.weight_version == version,
            f"completion sampled under version {c.weight_version}, the engine serves {version}",
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
    _serving(s)
    req = generation.request(_prompt(s), n=2, max_tokens=6, seed=1234)
    first, again = _generate(s, req), _generate(s, req)
    check(
        [list(c.token_ids) for c in first.completions] == [list(c.token_ids) for c in again.completions],
        "the same seeded request sampled different tokens",
    )


@contract.case(
    "generate.stop_kept",
    "Generate",
    "generation ends at the first stop token, which is kept, with finish_reason stop",
    "OK",
    "looprl.common.v1.SamplingParams.stop_token_ids",
    "the stop token is kept",
)
def _stop(s: Session) -> None:
    _serving(s)
    vocab = _model(s).config.vocab_size
    req = generation.request(_prompt(s), n=1, max_tokens=6, stop=tuple(range(vocab)))
    reply = _generate(s, req)
    generation.check_completions(req, reply)
    c = reply.completions[0]
    check(
        len(c.token_ids) == 1 and c.finish_reason == "stop",
        f"{len(c.token_ids)} tokens, finish_reason {c.finish_reason!r} when every token stops",
    )


def _valid(s: Session) -> pb.GenerateRequest:
    return generation.request(_prompt(s), n=1, max_tokens=4)


def _max_model_len(s: Session) -> int:
    value = s.option("max_model_len")
    if not value:
        skip("the engine's model length is unknown: pass --option max_model_len=N")
    return int(value)


generation.add_invalid_field_cases(contract, _valid, _generate, _serving, _max_model_len)


@contract.case(
    "abort.drops",
    "AbortWeights",
    "an aborted version is no longer staged and can never be committed; aborting again is harmless",
    "OK",
    "looprl.inference.v1.InferenceEngineService.AbortWeights",
    "Drop a staged version",
)
def _abort(s: Session) -> None:
    served = _serving(s)
    version = _next_version(s)
    _stage(s, stage_requests(_model(s), version))
    s.unary("AbortWeights", pb.AbortWeightsRequest(version=version), pb.AbortWeightsResponse)
    st = _status(s)
    check(
        st.staged_version != version and st.weight_version == served,
        f"after AbortWeights({version}): staged {st.staged_version}, serving {st.weight_version}",
    )
    s.refused(
        "FAILED_PRECONDITION",
        lambda: s.unary("CommitWeights", pb.CommitWeightsRequest(version=version), pb.CommitWeightsResponse),
    )
    s.unary("AbortWeights", pb.AbortWeightsRequest(version=version), pb.AbortWeightsResponse)


@contract.case(
    "stage.commit_when_complete",
    "StageWeights",
    "with commit_when_complete a one-rank engine serves the version once its last bucket is verified",
    "OK",
    "looprl.inference.v1.StageWeightsRequest.commit_when_complete",
    "the answer's serving_version then says it serves",
)
def _commit_when_complete(s: Session) -> None:
    previous = _serving(s)
    version = _next_version(s)
    reply = _stage(s, stage_requests(_model(s), version, commit_when_complete=True))
    check(
        reply.complete and reply.serving_version == version,
        f"complete={reply.complete}, serving_version {reply.serving_version}, expected {version}",
    )
    check(_status(s).weight_version == version, f"Status does not serve {version}")
    s.facts["version"], s.facts["previous"] = version, previous


@contract.case(
    "rollback.previous",
    "RollbackWeights",
    "rolling back the version served serves the one before it again",
    "OK",
    "looprl.inference.v1.InferenceEngineService.RollbackWeights",
    "serve the version that served before it again",
)
def _rollback(s: Session) -> None:
    version = _serving(s)
    previous = s.need(
        "previous", "no second version was committed (inference-engine.stage.commit_when_complete)"
    )
    reply = s.unary("RollbackWeights", pb.RollbackWeightsRequest(version=version), pb.RollbackWeightsResponse)
    check(
        reply.weight_version == previous,
        f"RollbackWeights({version}) serves {reply.weight_version}, expected {previous}",
    )
    completion = _generate(s, generation.request(_prompt(s), n=1, max_tokens=2)).completions[0]
    check(
        completion.weight_version == previous,
        f"after the rollback a completion carries version {completion.weight_version}",
    )
    s.facts["version"] = previous


@contract.case(
    "pause.holds",
    "Pause",
    "a paused engine holds requests (they wait, they are not refused) until Resume",
    "OK",
    "looprl.inference.v1.InferenceEngineService.Pause",
    "requests wait until Resume",
)
def _pause(s: Session) -> None:
    _serving(s)
    s.unary("Pause", pb.PauseRequest(), pb.PauseResponse)
    try:
        check(_status(s).paused, "Status.paused is false after Pause")
        s.refused(
            "DEADLINE_EXCEEDED",
            lambda: _generate(s, generation.request(_prompt(s), n=1, max_tokens=2), timeout=1.5),
        )
    finally:
        s.unary("Resume", pb.ResumeRequest(), pb.ResumeResponse)
    check(not _status(s).paused, "Status.paused is true after Resume")
    req = generation.request(_prompt(s), n=1, max_tokens=2)
    generation.check_completions(req, _generate(s, req))


@contract.case(
    "hold_for_version.timeout",
    "Generate",
    "an engine that holds requests for a version answers FAILED_PRECONDITION when it is not committed within version_wait_ms",
    "FAILED_PRECONDITION",
    "looprl.inference.v1.GenerateRequest.version_wait_ms",
    "FAILED_PRECONDITION naming min_weight_version",
)
def _hold(s: Session) -> None:
    version = _serving(s)
    if not _status(s).holds_for_version:
        skip("the engine does not hold requests for a version (holds_for_version false)")
    req = generation.request(_prompt(s), n=1, max_tokens=2, min_weight_version=version + 500)
    req.version_wait_ms = 300
    started = time.monotonic()
    s.refused("FAILED_PRECONDITION", lambda: _generate(s, req), naming="min_weight_version")
    check(time.monotonic() - started >= 0.25, "answered before version_wait_ms passed")


@contract.case(
    "probe.segment",
    "ProbeSharedMemory",
    "a segment name that is not weight-sync's is refused, a missing one is NOT_FOUND",
    "NOT_FOUND",
    "looprl.inference.v1.ProbeSharedMemoryRequest.segment",
    "never a path",
)
def _probe(s: Session) -> None:
    def probe(segment: str, nbytes: int = 8):
        return s.unary(
            "ProbeSharedMemory",
            pb.ProbeSharedMemoryRequest(segment=segment, nbytes=nbytes),
            pb.ProbeSharedMemoryResponse,
        )

    s.refused("INVALID_ARGUMENT", lambda: probe("../../etc/passwd"), naming="segment")
    s.refused("INVALID_ARGUMENT", lambda: probe("looprl-ws-1-conformance", 5000), naming="nbytes")
    s.refused("NOT_FOUND", lambda: probe("looprl-ws-1-conformance-missing"), naming="segment")
