"""Target registration: replicas of a deployment (named or in order), canary policy, bad input."""

from __future__ import annotations

import pytest

from looprl.weightsync.v1 import weightsync_pb2 as ws
from services.kit.rpc.errors import InvalidArgument
from services.weight_sync.targets import target_from_request


def request(ranks, tp=2, **kw):
    return ws.RegisterTargetRequest(
        deployment="d", layout=ws.TargetLayout(tensor_parallel=tp, naming="fused"), ranks=ranks, **kw
    )


def test_ranks_group_into_replicas_in_order_or_by_name():
    t = target_from_request(request([ws.TargetRank(rank=r % 2, address=f"h:{r}") for r in range(4)]))
    assert [[e.address for e in rep] for rep in t.replicas] == [["h:0", "h:1"], ["h:2", "h:3"]]
    named = [
        ws.TargetRank(rank=1, address="b1", replica="b"),
        ws.TargetRank(rank=0, address="a0", replica="a"),
        ws.TargetRank(rank=0, address="b0", replica="b"),
        ws.TargetRank(rank=1, address="a1", replica="a"),
    ]
    t = target_from_request(request(named, canary=True))
    assert [[(e.replica, e.rank) for e in rep] for rep in t.replicas] == [
        [("b", 0), ("b", 1)],
        [("a", 0), ("a", 1)],
    ]
    assert t.canary and t.canary_settings.prompts == []


@pytest.mark.parametrize(
    "req,field",
    [
        (
            request([ws.TargetRank(rank=0, address="x")] * 3),
            "ranks: tensor_parallel=2 needs 2 ranks per replica",
        ),
        (request([ws.TargetRank(rank=0, address="x")] * 2), "ranks.rank: replica replica-0"),
        (
            request([ws.TargetRank(rank=0, address="x", replica="a"), ws.TargetRank(rank=1, address="y")]),
            "ranks.replica",
        ),
        (
            request(
                [ws.TargetRank(rank=0, address="x")],
                tp=1,
                canary_policy=ws.CanaryPolicy(prompts=[ws.GoldenPrompt()]),
            ),
            "canary_policy.prompts[0].token_ids",
        ),
        (
            request(
                [ws.TargetRank(rank=0, address="x")],
                tp=1,
                canary_policy=ws.CanaryPolicy(max_logprob_drift=-1),
            ),
            "canary_policy.max_logprob_drift",
        ),
    ],
)
def test_bad_registrations_name_the_field(req, field):
    with pytest.raises(InvalidArgument) as info:
        target_from_request(req)
    assert field in str(info.value)


def test_only_a_lone_rank_without_a_canary_commits_as_its_last_bucket_lands():
    from services.weight_sync.deliver import _commits_alone

    lone = target_from_request(request([ws.TargetRank(rank=0, address="a")], tp=1))
    canary = target_from_request(request([ws.TargetRank(rank=0, address="c")], tp=1, canary=True))
    tp2 = target_from_request(request([ws.TargetRank(rank=r, address=f"t{r}") for r in range(2)]))
    two = target_from_request(request([ws.TargetRank(rank=0, address=f"r{i}") for i in range(2)], tp=1))
    assert _commits_alone(lone.endpoints, [lone, canary, tp2])
    assert not _commits_alone(canary.endpoints, [lone, canary])  # the canary checks it first
    assert not _commits_alone(tp2.endpoints[:1], [tp2])  # one rank of two must not switch alone
    # Two replicas staged by one delivery may share bytes each verifies only in part.
    assert not _commits_alone(two.endpoints, [two])
    assert not _commits_alone(lone.endpoints + tp2.endpoints[:1], [lone, tp2])
