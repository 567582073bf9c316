"""Routing policies on in-memory state: which deployment and replica a request lands on, and why."""

from __future__ import annotations

import time

import pytest

from services.inference_router.policies import (
    REASON_AFFINITY,
    REASON_AHEAD,
    REASON_FAILOVER_DEPLOYMENT,
    REASON_PINNED,
    REASON_PROFILE_CLOSEST,
    REASON_PROFILE_FIT,
    DeploymentState,
    LengthProfile,
    NoCapacity,
    NoDeployment,
    NoHealthyReplica,
    ReplicaState,
    RoundRobinDeployments,
    RouteRequest,
    RoutingPolicy,
    SessionAffinity,
    VersionUnavailable,
)


def _deployment(name: str, profile: LengthProfile, replicas: int = 2, max_model_len: int = 4096, **kw):
    dep = DeploymentState(name=name, profile=profile, max_model_len=max_model_len, **kw)
    dep.replicas = [
        ReplicaState(
            name=f"{name}-{i}", deployment=name, healthy=True, weight_version=3, max_outstanding_requests=4
        )
        for i in range(replicas)
    ]
    return dep


SHORT = LengthProfile(max_prompt_tokens=256, max_output_tokens=256)
LONG = LengthProfile(
    min_prompt_tokens=0, max_prompt_tokens=2048, min_output_tokens=257, max_output_tokens=2048
)


def _fleet():
    return [_deployment("short", SHORT), _deployment("long", LONG)]


def _req(prompt=10, out=16, **kw) -> RouteRequest:
    return RouteRequest(prompt_tokens=prompt, output_tokens=out, total_tokens=prompt + out, **kw)


def test_requests_land_on_the_deployment_whose_profile_fits():
    fleet = _fleet()
    policy = RoutingPolicy()
    short = policy.route(fleet, _req(10, 32))
    long = policy.route(fleet, _req(10, 1000))
    assert short.deployment.name == "short" and REASON_PROFILE_FIT in short.reasons
    assert long.deployment.name == "long" and REASON_PROFILE_FIT in long.reasons


def test_request_fitting_no_profile_goes_to_the_closest_with_a_reason():
    fleet = _fleet()
    decision = RoutingPolicy().route(fleet, _req(3000, 10))  # prompt too long for both profiles
    assert decision.deployment.name == "long"  # 952 tokens outside vs 2744 for "short"
    assert REASON_PROFILE_CLOSEST in decision.reasons


def test_ties_between_fitting_deployments_break_by_load():
    a, b = _deployment("a", SHORT), _deployment("b", SHORT)
    a.replicas[0].outstanding_tokens = 500
    a.replicas[1].outstanding_tokens = 500
    assert RoutingPolicy().route([a, b], _req()).deployment.name == "b"


def test_least_outstanding_tokens_inside_a_deployment():
    dep = _deployment("short", SHORT, replicas=3)
    dep.replicas[0].outstanding_tokens = 300
    dep.replicas[1].outstanding_tokens = 20
    dep.replicas[2].outstanding_tokens = 100
    assert RoutingPolicy().route([dep], _req()).replica.name == "short-1"


def test_equal_replicas_share_work():
    dep = _deployment("short", SHORT, replicas=2)
    policy = RoutingPolicy()
    names = {policy.route([dep], _req()).replica.name for _ in range(4)}
    assert names == {"short-0", "short-1"}


def test_session_sticks_to_its_replica_while_healthy_then_moves():
    fleet = _fleet()
    policy = RoutingPolicy(affinity=SessionAffinity())
    first = policy.route(fleet, _req(session_id="s1"))
    # Load the sticky replica: least-tokens would move it, affinity must not.
    first.replica.outstanding_tokens = 10_000
    again = policy.route(fleet, _req(session_id="s1", prompt=400))  # grown prompt no longer fits "short"
    assert again.replica is first.replica and again.reasons == (REASON_AFFINITY,)
    first.replica.healthy = False
    moved = policy.route(fleet, _req(session_id="s1"))
    assert moved.replica is not first.replica
    first.replica.healthy = True
    assert policy.route(fleet, _req(session_id="s1")).replica is moved.replica


def test_affinity_map_is_bounded_lru():
    aff = SessionAffinity(max_sessions=2)
    aff.remember("a", "r0")
    aff.remember("b", "r1")
    aff.lookup("a")
    aff.remember("c", "r2")
    assert len(aff) == 2 and aff.lookup("b") is None and aff.lookup("a") == "r0"


def test_min_weight_version_routes_only_to_new_enough_replicas():
    dep = _deployment("short", SHORT, replicas=2)
    dep.replicas[0].weight_version = 5
    for _ in range(3):
        assert RoutingPolicy().route([dep], _req(min_weight_version=5)).replica.name == "short-0"
    with pytest.raises(VersionUnavailable) as err:
        RoutingPolicy().route([dep], _req(min_weight_version=9))
    assert "min_weight_version" in str(err.value) and err.value.best == 5


def test_a_replica_that_holds_requests_takes_those_for_its_next_version_ahead_of_the_commit():
    dep = _deployment("short", SHORT, replicas=2)
    dep.replicas[1].holds_for_version = True
    decision = RoutingPolicy().route([dep], _req(min_weight_version=4, may_go_ahead=True))
    assert decision.ahead and decision.replica.name == "short-1" and REASON_AHEAD in decision.reasons
    # Not two versions ahead, not when the router does not wait for versions, not to one that does
    # not hold (it would serve the request at the version it has).
    for request in (_req(min_weight_version=5, may_go_ahead=True), _req(min_weight_version=4)):
        with pytest.raises(VersionUnavailable):
            RoutingPolicy().route([dep], request)
    dep.replicas[1].holds_for_version = False
    with pytest.raises(VersionUnavailable):
        RoutingPolicy().route([dep], _req(min_weight_version=4, may_go_ahead=True))
    # A replica that already serves the version is taken, not held.
    dep.replicas[0].weight_version = 4
    decision = RoutingPolicy().route([dep], _req(min_weight_version=4, may_go_ahead=True))
    assert decision.replica.name == "short-0" and not decision.ahead


def test_restarted_replica_stays_out_until_it_has_the_latest_version():
    dep = _deployment("short", SHORT, replicas=2)
    dep.replicas[0].resync_to_version = 3
    dep.replicas[0].weight_version = -1
    policy = RoutingPolicy()
    assert {policy.route([dep], _req()).replica.name for _ in range(4)} == {"short-1"}
    dep.replicas[0].weight_version = 3
    assert {policy.route([dep], _req()).replica.name for _ in range(4)} == {"short-0", "short-1"}


def test_failover_excludes_failed_replicas_then_uses_other_deployments_only_when_primary_is_down():
    fleet = _fleet()
    policy = RoutingPolicy()
    d = policy.route(fleet, _req(exclude=frozenset({"short-0"})))
    assert d.replica.name == "short-1"
    with_all_short_failed = _req(exclude=frozenset({"short-0", "short-1"}))
    d = policy.route(fleet, with_all_short_failed)
    assert d.deployment.name == "long" and REASON_FAILOVER_DEPLOYMENT in d.reasons
    with pytest.raises(NoHealthyReplica):
        policy.route(fleet, _req(exclude=frozenset(r.name for dep in fleet for r in dep.replicas)))


def test_full_queues_give_no_capacity_with_retry_hint_and_never_spill_to_a_mismatched_profile():
    fleet = _fleet()
    for r in fleet[0].replicas:
        r.outstanding_requests = r.max_outstanding_requests
    with pytest.raises(NoCapacity) as err:
        RoutingPolicy(retry_after_s=0.25).route(fleet, _req())
    assert err.value.retry_after_s == 0.25 and "short" in str(err.value)


def test_deployment_bound_applies_across_replicas():
    dep = _deployment("short", SHORT, replicas=2, max_outstanding_requests=1)
    dep.replicas[0].outstanding_requests = 1
    with pytest.raises(NoCapacity):
        RoutingPolicy().route([dep], _req())


def test_pinned_and_unknown_deployments_and_too_long_requests():
    fleet = _fleet()
    d = RoutingPolicy().route(fleet, _req(10, 1000, deployment="short"))
    assert d.deployment.name == "short" and REASON_PINNED in d.reasons
    with pytest.raises(NoDeployment, match="unknown deployment 'nope'"):
        RoutingPolicy().route(fleet, _req(deployment="nope"))
    with pytest.raises(NoDeployment, match=r"sampling\.max_tokens"):
        RoutingPolicy().route(fleet, _req(10, 5000))
    small = _deployment("small", SHORT, max_model_len=64)
    with pytest.raises(NoDeployment, match="max_model_len 64"):
        RoutingPolicy().route([small], _req(10, 100, deployment="small"))


def test_round_robin_baseline_ignores_lengths():
    fleet = _fleet()
    policy = RoutingPolicy(deployment_policy=RoundRobinDeployments())
    names = [policy.route(fleet, _req(10, 16)).deployment.name for _ in range(4)]
    assert sorted(names) == ["long", "long", "short", "short"]


def test_decision_is_fast():
    fleet = [_deployment(f"d{i}", SHORT if i % 2 else LONG, replicas=4) for i in range(4)]
    policy = RoutingPolicy(affinity=SessionAffinity())
    requests = [_req(10 + i, 16 + i, session_id=f"s{i % 50}") for i in range(2000)]
    start = time.perf_counter()
    for r in requests:
        policy.route(fleet, r)
    per_call = (time.perf_counter() - start) / len(requests)
    # Generous bound for a loaded CI box; the benchmark measures the real figure.
    assert per_call < 1e-3
