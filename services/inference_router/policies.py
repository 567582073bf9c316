"""Routing policies: pure, synchronous decisions over a snapshot of deployment and replica state.

Nothing here does I/O or awaits; the router (router.py) owns the state, calls `RoutingPolicy.route`
once per attempt and turns the outcome into a dispatch or a gRPC status. Keeping decisions pure
makes them cheap (tens of microseconds) and testable without processes.

A decision is composed of:

1. session affinity: a known session goes back to the replica that holds its cache, while that
   replica is routable, new enough, has room, and its deployment can hold the request;
2. a deployment policy that orders candidate deployments (length profile, pinned, or round-robin as
   the benchmark baseline), in tiers: the primary tier (deployments the request fits) and a
   failover tier that is used only when no primary deployment has a healthy replica;
3. replica filters with fixed meaning: excluded (already failed this request), healthy and synced,
   minimum weight version, and room under the per-replica and per-deployment queue bounds; when no
   replica serves the version yet, one at the version just before it that holds requests for their
   version (`ReplicaState.holds_for_version`) takes the request ahead of the commit;
4. a chain of replica pickers (least outstanding tokens by default; round-robin for baselines).

When nothing is eligible the policy raises the most useful reason: full queues (with a retry hint)
win over version gaps, which win over a lack of healthy replicas.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Decision reasons, also used as metric label values.
REASON_PINNED = "pinned"
REASON_PROFILE_FIT = "profile_fit"
REASON_PROFILE_CLOSEST = "profile_closest"
REASON_FAILOVER_DEPLOYMENT = "failover_deployment"
REASON_ROUND_ROBIN = "round_robin"
REASON_AFFINITY = "affinity"
REASON_AFFINITY_MOVED = "affinity_moved"
REASON_LEAST_TOKENS = "least_tokens"
REASON_RETRY = "retry"
REASON_AHEAD = "ahead_of_version"


@dataclass(frozen=True)
class LengthProfile:
    """Prompt and output token ranges a deployment is tuned for; a max of 0 means unbounded."""

    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0
    min_output_tokens: int = 0
    max_output_tokens: int = 0

    def distance(self, prompt_tokens: int, output_tokens: int) -> int:
        """Tokens by which a request falls outside this profile (0: it fits)."""
        return _outside(prompt_tokens, self.min_prompt_tokens, self.max_prompt_tokens) + _outside(
            output_tokens, self.min_output_tokens, self.max_output_tokens
        )

    def fits_output(self, output_tokens: int) -> bool:
        """The output length lies inside this profile's output range."""
        return _outside(output_tokens, self.min_output_tokens, self.max_output_tokens) == 0

    def validate(self, where: str) -> None:
        for name in ("min_prompt_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_prompt_tokens and self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(f"{where}: max_prompt_tokens < min_prompt_tokens")
        if self.max_output_tokens and self.max_output_tokens < self.min_output_tokens:
            raise ValueError(f"{where}: max_output_tokens < min_output_tokens")


def _outside(value: int, low: int, high: int) -> int:
    if value < low:
        return low - value
    if high and value > high:
        return value - high
    return 0


@dataclass(eq=False)
class ReplicaState:
    """What the router knows about one replica. Outstanding counts are the router's own accounting
    (exact and current); health and version come from status polls and weight events."""

    name: str
    deployment: str
    max_outstanding_requests: int = 64
    healthy: bool = False
    weight_version: int = -1
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    # Set when the replica restarted: it stays out of routing until it serves at least this version.
    resync_to_version: int | None = None
    sync_requested: bool = False
    address: str = ""
    metrics_address: str = ""  # its Prometheus /metrics, from its status ("" when it serves none)
    last_error: str = ""
    # It holds a request sent ahead of its version until that version commits (its status says so).
    holds_for_version: bool = False
    # A worker of a disaggregated deployment: ROLE_PREFILL or ROLE_DECODE; "" prefills and decodes.
    role: str = ""

    @property
    def routable(self) -> bool:
        if not self.healthy:
            return False
        return self.resync_to_version is None or self.weight_version >= self.resync_to_version

    @property
    def has_room(self) -> bool:
        return self.outstanding_requests < self.max_outstanding_requests


@dataclass(eq=False)
class DeploymentState:
    name: str
    profile: LengthProfile = field(default_factory=LengthProfile)
    max_model_len: int = 2048
    replicas: list[ReplicaState] = field(default_factory=list)
    # Bound on requests in flight across the deployment (0: only the per-replica bounds apply).
    max_outstanding_requests: int = 0
    backend: str = "cpu"
    tensor_parallel: int = 1
    vocab_size: int = 0
    layout: str = "hf"
    dtype: str = "float32"
    external: bool = False
    # The run this deployment serves ("": any run). `for_run`: started from that run's record, and
    # freed when the run ends (static and external deployments are neither).
    run_id: str = ""
    for_run: bool = False
    # Some replica has been routable: until then a run's requests wait for it rather than fail.
    ever_routable: bool = False
    # LoRA: the adapter (the run id) its replicas serve this run's requests with; its versions are
    # that adapter's.
    adapter: str = ""
    # Prefill/decode disaggregation: the policy places requests on decode workers (disaggregated.py
    # runs their prefill on a prefill worker first); the last split decision, as a sentence.
    disaggregated: bool = False
    split_decision: str = ""

    @property
    def outstanding_requests(self) -> int:
        return sum(r.outstanding_requests for r in self.replicas)

    @property
    def outstanding_tokens(self) -> int:
        return sum(r.outstanding_tokens for r in self.replicas)

    @property
    def has_room(self) -> bool:
        return not self.max_outstanding_requests or self.outstanding_requests < self.max_outstanding_requests

    def load(self) -> float:
        """Outstanding tokens per routable replica (inf when none can serve)."""
        routable = sum(1 for r in self.replicas if r.routable)
        return self.outstanding_tokens / routable if routable else float("inf")

    @property
    def latest_version(self) -> int:
        return max((r.weight_version for r in self.replicas), default=-1)


ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"


def placeable(dep: DeploymentState, live: list[ReplicaState]) -> list[ReplicaState]:
    """The replicas a request may be placed on: a disaggregated deployment's decode workers (they
    hold it to its last token), or, when none of them can, its prefill workers, which then decode."""
    if not dep.disaggregated:
        return live
    return [r for r in live if r.role == ROLE_DECODE] or live


@dataclass(frozen=True)
class RouteRequest:
    """The facts about a request that routing needs."""

    prompt_tokens: int
    # Expected completion length (the request's hint, else max_tokens): used for the profile.
    output_tokens: int
    # prompt + max_tokens: a deployment whose max_model_len is below this cannot serve the request.
    total_tokens: int
    session_id: str = ""
    deployment: str = ""
    min_weight_version: int = 0
    exclude: frozenset[str] = frozenset()
    # A replica one version behind may hold the request for its version (the router waits at all).
    may_go_ahead: bool = False


@dataclass(frozen=True)
class Decision:
    deployment: DeploymentState
    replica: ReplicaState
    reasons: tuple[str, ...]

    @property
    def ahead(self) -> bool:
        """The replica serves the version before the one asked for and holds the request until it commits."""
        return REASON_AHEAD in self.reasons


class RoutingError(Exception):
    """No replica can take the request now."""


class NoCapacity(RoutingError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class VersionUnavailable(RoutingError):
    def __init__(self, message: str, wanted: int, best: int) -> None:
        super().__init__(message)
        self.wanted = wanted
        self.best = best


class NoHealthyReplica(RoutingError):
    pass


class NoDeployment(RoutingError):
    """No deployment can hold the request at all (unknown name, or too long for every model)."""


@dataclass(frozen=True)
class Candidate:
    deployment: DeploymentState
    reason: str
    failover: bool = False


class DeploymentPolicy(Protocol):
    def rank(self, deployments: Sequence[DeploymentState], request: RouteRequest) -> list[Candidate]: ...


class ReplicaPicker(Protocol):
    """Picks one of `replicas` (all eligible) or returns None to let the next picker decide."""

    def pick(
        self, replicas: Sequence[ReplicaState], request: RouteRequest
    ) -> tuple[ReplicaState, str] | None: ...


class LengthProfilePolicy:
    """Deployments whose profile fits the request, least loaded first; if none fits, the closest
    profiles (by tokens outside the range), then load. Every other deployment that can hold the
    request forms the failover tier."""

    def rank(self, deployments: Sequence[DeploymentState], request: RouteRequest) -> list[Candidate]:
        scored = [
            (d.profile.distance(request.prompt_tokens, request.output_tokens), d.load(), i, d)
            for i, d in enumerate(deployments)
        ]
        scored.sort(key=lambda s: (s[0], s[1], s[2]))
        best = scored[0][0]
        reason = REASON_PROFILE_FIT if best == 0 else REASON_PROFILE_CLOSEST
        return [
            Candidate(d, reason) if dist == best else Candidate(d, REASON_FAILOVER_DEPLOYMENT, failover=True)
            for dist, _, _, d in scored
        ]


class RoundRobinDeployments:
    """Ignores lengths: cycles over deployments (the benchmark baseline)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, deployments: Sequence[DeploymentState], request: RouteRequest) -> list[Candidate]:
        start = next(self._counter) % len(deployments)
        ordered = list(deployments[start:]) + list(deployments[:start])
        return [Candidate(d, REASON_ROUND_ROBIN) for d in ordered]


class LeastOutstandingTokens:
    """The replica with the fewest tokens in flight; ties rotate so equal replicas share work."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> tuple[ReplicaState, str]:
        self._turn += 1
        n = len(replicas)
        offset = self._turn % n
        best = min(
            range(n),
            key=lambda i: (
                replicas[i].outstanding_tokens,
                replicas[i].outstanding_requests,
                (i - offset) % n,
            ),
        )
        return replicas[best], REASON_LEAST_TOKENS


class RoundRobinReplicas:
    def __init__(self) -> None:
        self._turn = 0

    def pick(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> tuple[ReplicaState, str]:
        self._turn += 1
        return replicas[self._turn % len(replicas)], REASON_ROUND_ROBIN


class SessionAffinity:
    """Bounded LRU map session id -> replica name."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._map: OrderedDict[str, str] = OrderedDict()

    def lookup(self, session_id: str) -> str | None:
        if not session_id:
            return None
        name = self._map.get(session_id)
        if name is not None:
            self._map.move_to_end(session_id)
        return name

    def remember(self, session_id: str, replica: str) -> None:
        if not session_id or self.max_sessions <= 0:
            return
        self._map[session_id] = replica
        self._map.move_to_end(session_id)
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        for session in [s for s, r in self._map.items() if r == replica]:
            del self._map[session]

    def __len__(self) -> int:
        return len(self._map)


@dataclass
class _Why:
    """Why candidates were rejected, to raise the most useful error."""

    full: list[str] = field(default_factory=list)
    best_version: int = -1
    version_blocked: bool = False
    unhealthy: list[str] = field(default_factory=list)


class RoutingPolicy:
    """Composes affinity, a deployment policy, the fixed replica filters and a picker chain."""

    def __init__(
        self,
        deployment_policy: DeploymentPolicy | None = None,
        pickers: Sequence[ReplicaPicker] | None = None,
        affinity: SessionAffinity | None = None,
        retry_after_s: float = 0.5,
    ) -> None:
        self.deployment_policy = deployment_policy or LengthProfilePolicy()
        self.pickers = list(pickers) if pickers is not None else [LeastOutstandingTokens()]
        self.affinity = affinity
        self.retry_after_s = retry_after_s

    def route(self, deployments: Sequence[DeploymentState], request: RouteRequest) -> Decision:
        eligible = self._deployments_that_hold(deployments, request)
        sticky = self._affine(eligible, request)
        if sticky is not None:
            return sticky
        candidates = (
            [Candidate(eligible[0], REASON_PINNED)]
            if request.deployment
            else self.deployment_policy.rank(eligible, request)
        )
        why = _Why()
        primary_unhealthy_only = True
        for cand in candidates:
            if cand.failover and not primary_unhealthy_only:
                break
            before_full, before_version = len(why.full), why.version_blocked
            decision = self._in_deployment(cand, request, why)
            if decision is not None:
                if self.affinity is not None:
                    self.affinity.remember(request.session_id, decision.replica.name)
                return decision
            if not cand.failover and (len(why.full) > before_full or why.version_blocked != before_version):
                # A primary deployment is merely busy or behind: do not spill onto a mismatched one.
                primary_unhealthy_only = False
        raise self._error(why, request)

    @staticmethod
    def _deployments_that_hold(
        deployments: Sequence[DeploymentState], request: RouteRequest
    ) -> list[DeploymentState]:
        if request.deployment:
            pinned = [d for d in deployments if d.name == request.deployment]
            if not pinned:
                known = ", ".join(sorted(d.name for d in deployments)) or "none"
                raise NoDeployment(f"deployment: unknown deployment {request.deployment!r} (known: {known})")
            if pinned[0].max_model_len < request.total_tokens:
                raise NoDeployment(
                    f"sampling.max_tokens: prompt + max_tokens = {request.total_tokens} exceeds "
                    f"max_model_len {pinned[0].max_model_len} of deployment {request.deployment!r}"
                )
            return pinned
        holding = [d for d in deployments if d.max_model_len >= request.total_tokens]
        if not holding:
            if not deployments:
                raise NoDeployment("no deployments are registered")
            longest = max(d.max_model_len for d in deployments)
            raise NoDeployment(
                f"sampling.max_tokens: prompt + max_tokens = {request.total_tokens} exceeds the longest "
                f"max_model_len of any deployment ({longest})"
            )
        return holding

    def _affine(self, eligible: Sequence[DeploymentState], request: RouteRequest) -> Decision | None:
        if self.affinity is None or not request.session_id:
            return None
        name = self.affinity.lookup(request.session_id)
        if name is None:
            return None
        for dep in eligible:
            for replica in dep.replicas:
                if replica.name == name:
                    if self._eligible(replica, request) and replica.has_room and dep.has_room:
                        return Decision(dep, replica, (REASON_AFFINITY,))
                    return None
        return None

    @staticmethod
    def _eligible(replica: ReplicaState, request: RouteRequest) -> bool:
        return (
            replica.name not in request.exclude
            and replica.routable
            and replica.weight_version >= request.min_weight_version
        )

    def _in_deployment(self, cand: Candidate, request: RouteRequest, why: _Why) -> Decision | None:
        dep = cand.deployment
        live = placeable(dep, [r for r in dep.replicas if r.name not in request.exclude and r.routable])
        if not live:
            why.unhealthy.append(dep.name)
            return None
        versioned = [r for r in live if r.weight_version >= request.min_weight_version]
        ahead = not versioned and request.may_go_ahead
        if ahead:
            # The next version is the one asked for: a replica that holds requests takes it now and
            # starts it the moment it commits (no router round trip between the commit and the work).
            versioned = [
                r
                for r in live
                if r.holds_for_version and 0 <= r.weight_version == request.min_weight_version - 1
            ]
        if not versioned:
            why.version_blocked = True
            why.best_version = max(why.best_version, max(r.weight_version for r in live))
            return None
        roomy = [r for r in versioned if r.has_room] if dep.has_room else []
        if not roomy:
            why.full.append(dep.name)
            return None
        for picker in self.pickers:
            picked = picker.pick(roomy, request)
            if picked is not None:
                replica, reason = picked
                reasons = [cand.reason, reason]
                if (
                    request.session_id
                    and self.affinity is not None
                    and self.affinity.lookup(request.session_id)
                ):
                    reasons.append(REASON_AFFINITY_MOVED)
                if request.exclude:
                    reasons.append(REASON_RETRY)
                if ahead:
                    reasons.append(REASON_AHEAD)
                return Decision(dep, replica, tuple(reasons))
        return None

    def _error(self, why: _Why, request: RouteRequest) -> RoutingError:
        if why.full:
            return NoCapacity(
                f"queues are full on deployment(s) {', '.join(why.full)}; retry later",
                retry_after_s=self.retry_after_s,
            )
        if why.version_blocked:
            return VersionUnavailable(
                f"min_weight_version: no replica serves weight version >= {request.min_weight_version} "
                f"(newest available: {why.best_version})",
                wanted=request.min_weight_version,
                best=why.best_version,
            )
        tried = f" (excluded after failures: {', '.join(sorted(request.exclude))})" if request.exclude else ""
        return NoHealthyReplica(
            f"no healthy, synced replica in deployment(s) {', '.join(why.unhealthy) or '-'}{tried}"
        )


def all_replicas(deployments: Iterable[DeploymentState]) -> Iterable[ReplicaState]:
    for dep in deployments:
        yield from dep.replicas
