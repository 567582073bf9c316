"""The router core: holds deployment/replica state, asks the policy for a decision per attempt,
dispatches to the replica, and handles what can go wrong.

- minimum weight version: if no replica is new enough, wait (bounded) for a version change, then
  fail with the configured status and a message naming min_weight_version;
- failover: a ReplicaFailure marks the replica unhealthy, excludes it for this request and retries
  elsewhere, at most `max_attempts` attempts; a request-level error (bad input) is never retried;
- backpressure: no queue in the router at all; full replica/deployment bounds answer
  RESOURCE_EXHAUSTED with a retry hint (the recent median latency) in trailing metadata;
- runs (run_scope.py): a request of run R goes only to R's own deployments (waiting, up to its
  deadline, while they start), else to the stack's shared ones; a pinned name resolves within R;
- health (replica_health.py): a status poll per replica (and weights.published events) updates
  versions and health; a replica whose poll fails also gives up the requests in flight there, which
  move to another replica (a host that vanished never answers them, and Ray may not declare its
  node dead before request_timeout_s); a replica that restarted is kept out of routing until it
  serves the newest version of its deployment, and its sessions are forgotten (their cache is gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from opentelemetry import trace

from looprl.inference.v1 import inference_pb2
from services.inference_router import metrics
from services.inference_router.config import RouterConfig
from services.inference_router.handles import ReplicaFailure, ReplicaHandle
from services.inference_router.policies import (
    Decision,
    DeploymentState,
    NoCapacity,
    NoDeployment,
    NoHealthyReplica,
    ReplicaState,
    RouteRequest,
    RoutingPolicy,
    VersionUnavailable,
)
from services.inference_router.replica_health import ReplicaHealth
from services.inference_router.run_scope import RunScope
from services.inference_router.split_tuning import SplitTuning, export_roles
from services.inference_router.two_phase import count_handoff, with_prefilled_kv
from services.kit.rpc import errors
from services.kit.telemetry import tracing as telemetry
from services.kit.telemetry.metrics import observe

log = logging.getLogger("looprl.inference_router")


class Router(ReplicaHealth):
    def __init__(
        self,
        policy: RoutingPolicy | None = None,
        config: RouterConfig | None = None,
        on_replica_restarted: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self.policy = policy or RoutingPolicy()
        self.config = config or RouterConfig()
        self.deployments: dict[str, DeploymentState] = {}
        self.handles: dict[str, ReplicaHandle] = {}
        self.replicas: dict[str, ReplicaState] = {}
        # Which deployments serve which run, and the runs whose deployments are starting.
        self.runs = RunScope()
        # Highest version announced per deployment (weights.published), beyond what polls saw.
        self.announced: dict[str, int] = {}
        self.decision_seconds: deque[float] = deque(maxlen=10_000)
        self._latencies: deque[float] = deque(maxlen=256)
        self._changed = asyncio.Event()
        self._on_replica_restarted = on_replica_restarted
        # Recreates a replica whose engine took itself out of service (deployment, replica, why);
        # the service sets it (DeploymentManager.recreate_replica). Asked once per breakage.
        self._on_replica_broken: Callable[[str, str, str], Awaitable[None]] | None = None
        self._recreating: set[str] = set()
        # Reports a replica failure to the run whose request met it (run id, message); the service
        # sets it once the bus is up. Reports never delay or fail the request.
        # Also takes fatal=True (the router gives up on the run: its deployments cannot start).
        self.report_to_run: Callable[..., Awaitable[None]] | None = None
        self._reports: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        # Set when a replica's status poll fails: its in-flight requests stop waiting for it.
        self._unreachable: dict[str, asyncio.Event] = {}
        # Each disaggregated deployment's split tuning (its owner adds it with the deployment).
        self.splits: dict[str, SplitTuning] = {}

    # ---- membership -------------------------------------------------------------------------

    def add_deployment(self, deployment: DeploymentState, handles: Sequence[ReplicaHandle]) -> None:
        if deployment.name in self.deployments:
            raise errors.AlreadyExists(f"deployment.name: deployment {deployment.name!r} already exists")
        by_name = {h.name: h for h in handles}
        for replica in deployment.replicas:
            self.handles[replica.name] = by_name[replica.name]
            self.replicas[replica.name] = replica
        self.deployments[deployment.name] = deployment
        metrics.init_deployment(deployment.name, [r.name for r in deployment.replicas])
        if deployment.disaggregated:
            metrics.init_disaggregated(deployment.name)
            export_roles(deployment)
        self._notify()

    async def remove_deployment(self, name: str) -> DeploymentState | None:
        """Take a deployment out of routing and listings (its replicas are its owner's to stop)."""
        dep = self.deployments.pop(name, None)
        self.splits.pop(name, None)
        if dep is None:
            return None
        self.announced.pop(name, None)
        for replica in dep.replicas:
            self.replicas.pop(replica.name, None)
            self._unreachable.pop(replica.name, None)
            if self.policy.affinity is not None:
                self.policy.affinity.forget_replica(replica.name)
            handle = self.handles.pop(replica.name, None)
            if handle is not None:
                try:
                    await handle.close()
                except Exception as exc:
                    log.warning("closing replica %s: %s", replica.name, exc)
        metrics.drop_deployment(name, [r.name for r in dep.replicas])
        self._notify()
        return dep

    def notify(self) -> None:
        """Something routing depends on changed (e.g. a run's deployments started): decide again."""
        self._notify()

    def deployment_list(self) -> list[DeploymentState]:
        return list(self.deployments.values())

    # ---- generation -------------------------------------------------------------------------

    def route_request(
        self, request: inference_pb2.GenerateRequest, exclude: frozenset[str], deployment: str | None = None
    ) -> RouteRequest:
        """`deployment`: the pinned deployment as resolved for the request's run (default: as given)."""
        s = request.sampling
        prompt = len(request.prompt_token_ids)
        return RouteRequest(
            prompt_tokens=prompt,
            output_tokens=request.expected_output_tokens or s.max_tokens,
            total_tokens=prompt + s.max_tokens,
            session_id=request.session_id,
            deployment=request.deployment if deployment is None else deployment,
            min_weight_version=request.min_weight_version,
            exclude=exclude,
            may_go_ahead=self.config.version_wait_s > 0,
        )

    def decide(self, route: RouteRequest, deployments: Sequence[DeploymentState] | None = None):
        """The policy's decision among `deployments` (default: every deployment)."""
        start = time.perf_counter()
        try:
            return self.policy.route(self.deployment_list() if deployments is None else deployments, route)
        finally:
            elapsed = time.perf_counter() - start
            self.decision_seconds.append(elapsed)
            metrics.DECISION_SECONDS.observe(elapsed)

    async def _choose(self, request: inference_pb2.GenerateRequest, exclude: set[str], deadline: float):
        """A decision, waiting (bounded) for versions or health to change when none is possible.
        A request of a run whose deployments are still starting waits for them until its deadline."""
        run_id = request.run_id
        # A run's request may come just before the router saw its record: it waits below instead.
        if not self.deployments and not run_id:
            metrics.REJECTIONS.labels("unavailable").inc()
            raise errors.Unavailable("no deployments are registered yet", retry_after_s=1.0)
        loop = asyncio.get_running_loop()
        version_deadline = loop.time() + self.config.version_wait_s
        health_deadline = loop.time() + self.config.unavailable_wait_s
        while True:
            changed = self._changed
            loading = self.runs.loading(self.deployments, run_id)
            if run_id in self.runs.failed:
                metrics.REJECTIONS.labels("unavailable").inc()
                raise errors.Unavailable(
                    f"run {run_id!r}: its deployments could not start: {self.runs.failed[run_id]}"
                )
            pinned = (
                self.runs.resolve(self.deployments, run_id, request.deployment) if request.deployment else ""
            )
            candidates = (
                (self.deployment_list() if pinned in self.deployments else [])
                if pinned
                else self.runs.candidates(self.deployments, run_id)
            )
            if not candidates:
                # Only a run's deployments that are starting (or a run not yet seen) are waited for.
                until = deadline if loading else min(health_deadline, deadline)
                if not await _wait(changed, until - loop.time()):
                    metrics.REJECTIONS.labels("unavailable").inc()
                    what = f"run {run_id!r} has no deployment serving yet" if run_id else "no deployment"
                    raise errors.Unavailable(what, retry_after_s=1.0)
                continue
            try:
                return self.decide(self.route_request(request, frozenset(exclude), pinned), candidates)
            except NoDeployment as exc:
                metrics.REJECTIONS.labels("invalid").inc()
                raise errors.InvalidArgument(str(exc)) from None
            except NoCapacity as exc:
                metrics.REJECTIONS.labels("backpressure").inc()
                raise errors.ResourceExhausted(str(exc), retry_after_s=self.retry_hint()) from None
            except VersionUnavailable as exc:
                until = min(version_deadline, deadline)
                if not await _wait(changed, until - loop.time()):
                    waited = (
                        f" after waiting {self.config.version_wait_s:.1f}s"
                        if self.config.version_wait_s
                        else ""
                    )
                    raise self._version_unavailable(f"{exc}{waited}") from None
            except NoHealthyReplica as exc:
                until = deadline if loading else min(health_deadline, deadline)
                if not await _wait(changed, until - loop.time()):
                    metrics.REJECTIONS.labels("unavailable").inc()
                    raise errors.Unavailable(str(exc), retry_after_s=self.retry_hint()) from None

    async def generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> inference_pb2.GenerateResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.request_timeout_s)
        exclude: set[str] = set()
        last_failure = ""
        request.kv_transfer_params = ""  # the router's to set (two_phase.py), never a caller's
        for attempt in range(1, self.config.max_attempts + 1):
            decision = await self._choose(request, exclude, deadline)
            replica, dep = decision.replica, decision.deployment
            self._count_decision(decision)
            self._hold_ahead(request, decision, deadline)
            reserved = self._reserve(replica, request)
            start = time.perf_counter()
            try:
                outgoing = request
                if dep.disaggregated:
                    outgoing = await with_prefilled_kv(self, request, dep, replica, deadline, exclude)
                response = await self._unless_unreachable(
                    replica.name,
                    self.handles[replica.name].generate(
                        outgoing, min(self.config.request_timeout_s, max(0.01, deadline - loop.time()))
                    ),
                )
            except ReplicaFailure as exc:
                self._replica_failed(replica, exc, request.run_id)
                exclude.add(replica.name)
                last_failure = str(exc)
                if attempt < self.config.max_attempts:
                    metrics.RETRIES.labels(dep.name, replica.name).inc()
                continue
            except errors.ServiceError as exc:
                metrics.REQUESTS.labels(dep.name, replica.name, "rejected").inc()
                raise self._refusal(exc, decision) from None
            finally:
                self._release(replica, reserved)
            self._finished(dep, replica, request, response, time.perf_counter() - start)
            if dep.disaggregated:
                count_handoff(dep, response)
                split = self.splits.get(dep.name)
                if split is not None:
                    split.observe_request(
                        len(request.prompt_token_ids), [len(c.token_ids) for c in response.completions]
                    )
            response.deployment = dep.name
            response.replica = replica.name
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attributes(
                    {
                        telemetry.ATTR.DEPLOYMENT: dep.name,
                        telemetry.ATTR.REPLICA: replica.name,
                        telemetry.ATTR.WEIGHT_VERSION: min(
                            (c.weight_version for c in response.completions), default=-1
                        ),
                        telemetry.ATTR.TOKENS: response.prompt_tokens
                        + sum(len(c.token_ids) for c in response.completions),
                        "looprl.attempts": attempt,
                    }
                )
            return response
        metrics.REJECTIONS.labels("attempts").inc()
        raise errors.Unavailable(
            f"request failed on {self.config.max_attempts} replicas; last error: {last_failure}",
            retry_after_s=self.retry_hint(),
        )

    async def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        """Chunks as sampled. Failover is transparent only until the first chunk went out: after
        that a retry would duplicate tokens, so a mid-stream failure ends the call with UNAVAILABLE."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.request_timeout_s)
        exclude: set[str] = set()
        last_failure = ""
        request.kv_transfer_params = ""
        for _attempt in range(self.config.max_attempts):
            decision = await self._choose(request, exclude, deadline)
            replica, dep = decision.replica, decision.deployment
            self._count_decision(decision)
            self._hold_ahead(request, decision, deadline)
            reserved = self._reserve(replica, request)
            start = time.perf_counter()
            sent = 0
            tokens = 0
            lengths: dict[int, int] = {}
            try:
                outgoing = request
                if dep.disaggregated:
                    outgoing = await with_prefilled_kv(self, request, dep, replica, deadline, exclude)
                stream = self.handles[replica.name].generate_stream(
                    outgoing, min(self.config.request_timeout_s, max(0.01, deadline - loop.time()))
                )
                async for chunk in stream:
                    chunk.deployment = dep.name
                    chunk.replica = replica.name
                    tokens += len(chunk.token_ids)
                    lengths[chunk.index] = lengths.get(chunk.index, 0) + len(chunk.token_ids)
                    sent += 1
                    yield chunk
            except ReplicaFailure as exc:
                self._replica_failed(replica, exc, request.run_id)
                if sent:
                    metrics.REQUESTS.labels(dep.name, replica.name, "failed").inc()
                    raise errors.Unavailable(
                        f"replica {replica.name} failed after {tokens} streamed tokens: {exc.why}"
                    ) from None
                exclude.add(replica.name)
                last_failure = str(exc)
                metrics.RETRIES.labels(dep.name, replica.name).inc()
                continue
            except errors.ServiceError as exc:
                raise self._refusal(exc, decision) from None
            finally:
                self._release(replica, reserved)
            metrics.REQUESTS.labels(dep.name, replica.name, "ok").inc()
            metrics.TOKENS.labels(dep.name, replica.name, "completion").inc(tokens)
            metrics.TOKENS.labels(dep.name, replica.name, "prompt").inc(len(request.prompt_token_ids))
            observe(metrics.LATENCY.labels(dep.name), time.perf_counter() - start)
            _judge_prediction(dep, request, list(lengths.values()))
            return
        raise errors.Unavailable(
            f"request failed on {self.config.max_attempts} replicas; last error: {last_failure}",
            retry_after_s=self.retry_hint(),
        )

    def _hold_ahead(
        self, request: inference_pb2.GenerateRequest, decision: Decision, deadline: float
    ) -> None:
        """How long the replica may hold the request for its version: what is left of the version
        wait when sent ahead of the version, else nothing (a caller's value is not passed on)."""
        wait_s = min(self.config.version_wait_s, deadline - asyncio.get_running_loop().time())
        request.version_wait_ms = max(1, int(wait_s * 1000)) if decision.ahead else 0

    def _refusal(self, exc: errors.ServiceError, decision: Decision) -> errors.ServiceError:
        """A replica's refusal as the caller gets it: a request sent ahead that the replica held as
        long as the version wait allows without the version arriving fails like one that waited here."""
        if decision.ahead and isinstance(exc, errors.FailedPrecondition):
            return self._version_unavailable(exc.message)
        return exc

    def _version_unavailable(self, message: str) -> errors.ServiceError:
        metrics.REJECTIONS.labels("version").inc()
        if self.config.version_unavailable_code == "UNAVAILABLE":
            return errors.Unavailable(message)
        return errors.FailedPrecondition(message)

    def retry_hint(self) -> float:
        if not self._latencies:
            return max(self.config.min_retry_after_s, 0.1)
        ordered = sorted(self._latencies)
        return max(self.config.min_retry_after_s, ordered[len(ordered) // 2])

    def _count_decision(self, decision: Any) -> None:
        for reason in decision.reasons:
            metrics.DECISIONS.labels(decision.deployment.name, reason).inc()

    @staticmethod
    def _tokens_of(request: inference_pb2.GenerateRequest) -> int:
        return len(request.prompt_token_ids) + (request.sampling.n or 1) * request.sampling.max_tokens

    def _reserve(self, replica: ReplicaState, request: inference_pb2.GenerateRequest) -> int:
        tokens = self._tokens_of(request)
        replica.outstanding_requests += 1
        replica.outstanding_tokens += tokens
        self._export_load(replica)
        return tokens

    def _release(self, replica: ReplicaState, tokens: int) -> None:
        # No _notify: the waits in _choose are for versions, health and starting deployments, none of
        # which room changes (a full queue is answered RESOURCE_EXHAUSTED at once); waking them on
        # every finished request re-routed each waiting request once per request a step finishes.
        replica.outstanding_requests -= 1
        replica.outstanding_tokens -= tokens
        self._export_load(replica)

    @staticmethod
    def _export_load(replica: ReplicaState) -> None:
        metrics.OUTSTANDING_REQUESTS.labels(replica.deployment, replica.name).set(
            replica.outstanding_requests
        )
        metrics.OUTSTANDING_TOKENS.labels(replica.deployment, replica.name).set(replica.outstanding_tokens)

    def _finished(self, dep, replica, request, response, seconds: float) -> None:
        self._latencies.append(seconds)
        metrics.REQUESTS.labels(dep.name, replica.name, "ok").inc()
        metrics.TOKENS.labels(dep.name, replica.name, "prompt").inc(len(request.prompt_token_ids))
        metrics.TOKENS.labels(dep.name, replica.name, "completion").inc(
            sum(len(c.token_ids) for c in response.completions)
        )
        observe(metrics.LATENCY.labels(dep.name), seconds)
        _judge_prediction(dep, request, [len(c.token_ids) for c in response.completions])

    async def _unless_unreachable(self, name: str, call: Awaitable[Any]) -> Any:
        """`call`'s result, or ReplicaFailure once the replica's status poll fails meanwhile (the
        call is abandoned: the request is retried elsewhere like any failed attempt)."""
        lost = self._unreachable.setdefault(name, asyncio.Event())
        task = asyncio.ensure_future(call)
        waiter = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ReplicaFailure(name, "stopped answering its status polls; the request moved elsewhere")
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        for handle in self.handles.values():
            await handle.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _judge_prediction(
    dep: DeploymentState, request: inference_pb2.GenerateRequest, lengths: Sequence[int]
) -> None:
    """The prediction error of each completion, and whether its real length fit the profile of the
    deployment it was routed to by that prediction."""
    expected = request.expected_output_tokens
    for n in lengths:
        if expected <= 0:
            metrics.LENGTH_PREDICTIONS.labels(dep.name, "unpredicted").inc()
            continue
        observe(metrics.LENGTH_ERROR.labels(dep.name), abs(n - expected))
        outcome = "in_profile" if dep.profile.fits_output(n) else "outside_profile"
        metrics.LENGTH_PREDICTIONS.labels(dep.name, outcome).inc()


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """True if the event fired within timeout (state changed: decide again)."""
    if timeout <= 0:
        return False
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False
