"""Prometheus metrics of the reward service (names: services/kit/telemetry/metrics.py): scores given,
time to score, and failed components by reason, per reward name."""

from __future__ import annotations

from collections.abc import Iterable

from services.kit.telemetry.metrics import counter, histogram

SCORES = histogram("looprl_reward_score")
SECONDS = histogram("looprl_reward_seconds")
FAILURES = counter("looprl_reward_failures_total")

# Why a component failed: it ran past its timeout, its verifier refused the input, or it raised.
FAILURE_REASONS = ("timeout", "rejected", "crashed")


def init_rewards(names: Iterable[str]) -> None:
    """Every registered reward's series at zero."""
    for name in names:
        SCORES.labels(name)
        SECONDS.labels(name)
        for reason in FAILURE_REASONS:
            FAILURES.labels(name, reason)
