"""The reward contract (looprl.reward.v1.RewardService): scores that are finite and explain
themselves, refusals that name the field, and ScoreBatch answering as Score would, in order.

The kit scores, with every reward the service lists, a few inputs that any reward must answer
without error: a task with a reference answer and a completion that matches it, one that does not,
and an empty task (which a verifier cannot score: it must say so in a failed component, not
answer a silent 0).
"""

from __future__ import annotations

import json
import math

from conformance.case import Contract, check, skip
from conformance.common import add_common
from conformance.target import Session
from looprl.reward.v1 import reward_pb2 as pb

SERVICE = "looprl.reward.v1.RewardService"
contract = Contract(
    "reward",
    SERVICE,
    "rewards by name: Score, ScoreBatch (a GRPO group in one call) and ListRewards",
    options={"reward": "the reward to score with (default: every reward the service lists)"},
)
add_common(contract, "ListRewards", pb.ListRewardsRequest())

KINDS = ("verifier", "model", "composite", "plugin")
MAX_BATCH = 1024


def _inputs(reward: str) -> list[pb.ScoreRequest]:
    """Inputs every reward answers: a reference answer met, one missed, and no task at all."""
    task = json.dumps({"op": "rev", "digits": "123", "answer": "321", "target": "321"})
    return [
        pb.ScoreRequest(reward=reward, task_json=task, completion="321", rollout_id="conformance-0"),
        pb.ScoreRequest(reward=reward, task_json=task, completion="x9", rollout_id="conformance-1"),
        pb.ScoreRequest(reward=reward, task_json="", completion="321", rollout_id="conformance-2"),
    ]


def _rewards(s: Session) -> list[str]:
    chosen = s.option("reward")
    if chosen:
        return [chosen]
    if "rewards" not in s.facts:
        reply = s.unary("ListRewards", pb.ListRewardsRequest(), pb.ListRewardsResponse)
        s.facts["rewards"] = [r.name for r in reply.rewards if r.name]
    return s.facts["rewards"]


def _check_response(r: pb.ScoreResponse, where: str) -> None:
    check(math.isfinite(r.score), f"{where}: score is {r.score}, not a finite number")
    for c in r.components:
        check(math.isfinite(c.score), f"{where}: component {c.name!r} score is {c.score}")
        check(math.isfinite(c.weight), f"{where}: component {c.name!r} weight is {c.weight}")


@contract.case(
    "list.names",
    "ListRewards",
    "lists at least one reward, each with a unique non-empty name and a known kind",
    "OK",
    "looprl.reward.v1.RewardInfo.kind",
    '"verifier", "model", "composite" or "plugin"',
)
def _list(s: Session) -> None:
    reply = s.unary("ListRewards", pb.ListRewardsRequest(), pb.ListRewardsResponse)
    names = [r.name for r in reply.rewards]
    check(names, "lists no reward")
    check(all(names), f"a reward has an empty name: {names}")
    check(len(set(names)) == len(names), f"names repeat: {names}")
    for r in reply.rewards:
        check(r.kind in KINDS, f"reward {r.name!r} has kind {r.kind!r}, not one of {KINDS}")
    s.facts["rewards"] = names
    s.facts["kinds"] = {r.name: r.kind for r in reply.rewards}


@contract.case(
    "score.finite",
    "Score",
    "every score and component score is a finite number",
    "OK",
    "looprl.reward.v1.ScoreResponse.score",
    "always finite",
)
def _finite(s: Session) -> None:
    for reward in _rewards(s):
        for i, request in enumerate(_inputs(reward)):
            _check_response(s.unary("Score", request, pb.ScoreResponse), f"Score({reward!r}, input {i})")


@contract.case(
    "score.explained",
    "Score",
    "ok is false exactly when a component failed, a failed component says why, and the score sums weight x score over the components that succeeded",
    "OK",
    "looprl.reward.v1.ScoreResponse.score",
    "weight * score over the components whose ok is true",
)
def _explained(s: Session) -> None:
    for reward in _rewards(s):
        for i, request in enumerate(_inputs(reward)):
            r = s.unary("Score", request, pb.ScoreResponse)
            where = f"Score({reward!r}, input {i})"
            check(r.components, f"{where}: no components")
            check(
                r.ok == all(c.ok for c in r.components),
                f"{where}: ok={r.ok} but components say {[c.ok for c in r.components]}",
            )
            for c in r.components:
                check(c.ok or c.reason, f"{where}: component {c.name!r} failed without a reason")
            total = sum(c.weight * c.score for c in r.components if c.ok)
            check(
                math.isclose(r.score, total, rel_tol=1e-9, abs_tol=1e-12),
                f"{where}: score {r.score} != sum of weight*score {total}",
            )


@contract.case(
    "score.idempotent",
    "Score",
    "scoring the same request again gives the same answer",
    "OK",
    "looprl.reward.v1.ScoreRequest.rollout_id",
    "same request always scores the same",
)
def _idempotent(s: Session) -> None:
    for reward in _rewards(s):
        request = _inputs(reward)[0]
        first = s.unary("Score", request, pb.ScoreResponse)
        again = s.unary("Score", request, pb.ScoreResponse)
        check(first == again, f"Score({reward!r}) answered {first.score} then {again.score}")


@contract.case(
    "score.reward_required",
    "Score",
    "an empty reward name is refused naming `reward`",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.ScoreRequest.reward",
    "empty: INVALID_ARGUMENT",
)
def _reward_required(s: Session) -> None:
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("Score", pb.ScoreRequest(completion="1"), pb.ScoreResponse),
        naming="reward",
    )


@contract.case(
    "score.unknown_reward",
    "Score",
    "a reward the service does not list is refused naming `reward`",
    "NOT_FOUND",
    "looprl.reward.v1.ScoreRequest.reward",
    "not listed by ListRewards: NOT_FOUND",
)
def _unknown(s: Session) -> None:
    request = pb.ScoreRequest(reward="conformance-no-such-reward", completion="1")
    s.refused("NOT_FOUND", lambda: s.unary("Score", request, pb.ScoreResponse), naming="reward")


@contract.case(
    "score.task_json",
    "Score",
    "task_json that is not a JSON object is refused naming `task_json`",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.ScoreRequest.task_json",
    "not a JSON object: INVALID_ARGUMENT",
)
def _task_json(s: Session) -> None:
    reward = _rewards(s)[0]
    for bad in ("{not json", "[1, 2]"):
        request = pb.ScoreRequest(reward=reward, task_json=bad, completion="1")
        s.refused(
            "INVALID_ARGUMENT", lambda r=request: s.unary("Score", r, pb.ScoreResponse), naming="task_json"
        )


@contract.case(
    "score.environment_reward",
    "Score",
    "a non-finite environment_reward is refused naming it",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.ScoreRequest.environment_reward",
    "NaN or infinite: INVALID_ARGUMENT",
)
def _environment_reward(s: Session) -> None:
    reward = _rewards(s)[0]
    for bad in (math.nan, math.inf):
        request = pb.ScoreRequest(reward=reward, completion="1", environment_reward=bad)
        s.refused(
            "INVALID_ARGUMENT",
            lambda r=request: s.unary("Score", r, pb.ScoreResponse),
            naming="environment_reward",
        )


@contract.case(
    "batch.in_order",
    "ScoreBatch",
    "answers one response per request, in order, each as Score answers it",
    "OK",
    "looprl.reward.v1.ScoreBatchResponse.responses",
    "One per request, in the same order",
)
def _batch(s: Session) -> None:
    requests = [r for reward in _rewards(s) for r in _inputs(reward)]
    requests = requests + requests[::-1]
    reply = s.unary("ScoreBatch", pb.ScoreBatchRequest(requests=requests), pb.ScoreBatchResponse)
    check(
        len(reply.responses) == len(requests), f"{len(reply.responses)} responses to {len(requests)} requests"
    )
    for i, (request, response) in enumerate(zip(requests, reply.responses, strict=True)):
        _check_response(response, f"responses[{i}]")
        alone = s.unary("Score", request, pb.ScoreResponse)
        check(
            alone == response,
            f"responses[{i}] is {response.score} (ok={response.ok}), Score answers {alone.score} (ok={alone.ok})",
        )


@contract.case(
    "batch.empty",
    "ScoreBatch",
    "an empty batch answers no responses",
    "OK",
    "looprl.reward.v1.ScoreBatchRequest.requests",
    "empty: no responses",
)
def _batch_empty(s: Session) -> None:
    reply = s.unary("ScoreBatch", pb.ScoreBatchRequest(), pb.ScoreBatchResponse)
    check(not reply.responses, f"{len(reply.responses)} responses to an empty batch")


@contract.case(
    "batch.validated_first",
    "ScoreBatch",
    "a bad request fails the whole call naming it as requests[i]",
    "NOT_FOUND",
    "looprl.reward.v1.RewardService.ScoreBatch",
    "naming it as requests[i]",
)
def _batch_bad(s: Session) -> None:
    reward = _rewards(s)[0]
    requests = [*_inputs(reward)[:2], pb.ScoreRequest(reward="conformance-no-such-reward", completion="1")]
    s.refused(
        "NOT_FOUND",
        lambda: s.unary("ScoreBatch", pb.ScoreBatchRequest(requests=requests), pb.ScoreBatchResponse),
        naming="requests[2]",
    )
    requests = [_inputs(reward)[0], pb.ScoreRequest(reward=reward, task_json="[]", completion="1")]
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("ScoreBatch", pb.ScoreBatchRequest(requests=requests), pb.ScoreBatchResponse),
        naming="requests[1].task_json",
    )


@contract.case(
    "batch.limit",
    "ScoreBatch",
    "more than 1024 requests in one call are refused naming `requests`",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.ScoreBatchRequest.requests",
    "at most 1024",
)
def _batch_limit(s: Session) -> None:
    rewards = _rewards(s)
    if not rewards:
        skip("no reward to score with")
    one = pb.ScoreRequest(reward=rewards[0], completion="1")
    request = pb.ScoreBatchRequest(requests=[one] * (MAX_BATCH + 1))
    s.refused(
        "INVALID_ARGUMENT", lambda: s.unary("ScoreBatch", request, pb.ScoreBatchResponse), naming="requests"
    )


@contract.case(
    "load.registered",
    "LoadReward",
    "loading a listed reward answers it as ListRewards lists it",
    "OK",
    "looprl.reward.v1.LoadRewardResponse.reward",
    "as ListRewards lists it",
)
def _load(s: Session) -> None:
    listed = s.unary("ListRewards", pb.ListRewardsRequest(), pb.ListRewardsResponse)
    for info in listed.rewards:
        if info.kind == "plugin":
            continue
        reply = s.unary("LoadReward", pb.LoadRewardRequest(reward=info.name), pb.LoadRewardResponse)
        check(
            reply.reward.name == info.name and reply.reward.kind == info.kind,
            f"LoadReward({info.name!r}) answered {reply.reward.name!r} ({reply.reward.kind}), ListRewards says {info.kind}",
        )
        check(
            not reply.trials,
            f"LoadReward({info.name!r}) scored {len(reply.trials)} trials for a reward that is not a plugin",
        )


@contract.case(
    "load.required",
    "LoadReward",
    "an empty reward name is refused naming `reward`",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.LoadRewardRequest.reward",
    "empty: INVALID_ARGUMENT naming reward",
)
def _load_required(s: Session) -> None:
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("LoadReward", pb.LoadRewardRequest(), pb.LoadRewardResponse),
        naming="reward",
    )


@contract.case(
    "load.unknown",
    "LoadReward",
    "a reward that is neither registered nor a plugin is refused",
    "NOT_FOUND",
    "looprl.reward.v1.RewardService.LoadReward",
    "NOT_FOUND for an unknown reward",
)
def _load_unknown(s: Session) -> None:
    request = pb.LoadRewardRequest(reward="conformance-no-such-reward")
    s.refused("NOT_FOUND", lambda: s.unary("LoadReward", request, pb.LoadRewardResponse))


@contract.case(
    "load.settings",
    "LoadReward",
    "settings for a reward that is not a plugin are refused",
    "INVALID_ARGUMENT",
    "looprl.reward.v1.LoadRewardRequest.config_json",
    "settings for it are INVALID_ARGUMENT",
)
def _load_settings(s: Session) -> None:
    kinds = s.facts.get("kinds") or {}
    names = [n for n in _rewards(s) if kinds.get(n, "verifier") != "plugin"]
    if not names:
        skip("every reward listed is a plugin")
    request = pb.LoadRewardRequest(reward=names[0], config_json='{"conformance": 1}')
    s.refused("INVALID_ARGUMENT", lambda: s.unary("LoadReward", request, pb.LoadRewardResponse))
