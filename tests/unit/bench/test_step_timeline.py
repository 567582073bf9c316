"""The step timeline lines every moment up on its own trainer step, from the span log's records."""

from __future__ import annotations

import pytest

from bench.step_timeline import (
    COMMIT,
    GENERATE,
    NEXT_BATCH,
    PUSH,
    STAGE,
    STEP,
    medians,
    record_lags,
    step_moments,
)

MS = 1_000_000


def span(service: str, name: str, start_ms: float, end_ms: float, **attributes: str) -> dict:
    return {
        "service": service,
        "name": name,
        "start_ns": int(start_ms * MS),
        "end_ns": int(end_ms * MS),
        "attributes": attributes,
    }


def one_step(step: int, with_commit: bool = True) -> list[dict]:
    t0, version = 1000.0 * step, str(step)
    spans = [
        span("trainer", STEP, t0, t0 + 150, **{"looprl.step": version}),
        span("inference-replica", GENERATE, t0 + 20, t0 + 45, **{"looprl.weight_version": version}),
        span("inference-replica", GENERATE, t0 + 25, t0 + 60, **{"looprl.weight_version": version}),
        span("trainer", NEXT_BATCH, t0 + 2, t0 + 95),
        span("trainer", PUSH, t0 + 132, t0 + 141),
        # Another run's generation at another version, inside this step's window, is not this step's.
        span("inference-replica", GENERATE, t0 + 1, t0 + 140, **{"looprl.weight_version": str(step + 100)}),
    ]
    if with_commit:
        spans.append(span("inference-replica", COMMIT, t0 + 5, t0 + 10, **{"looprl.weight_version": version}))
    return spans


def test_every_moment_is_measured_from_its_own_steps_start() -> None:
    spans = [s for step in range(10) for s in one_step(step, with_commit=step != 7)]
    moments = step_moments(spans)
    assert len(moments) == 9  # step 7 lacks its commit
    m = medians(moments)
    assert m["steps"] == 3  # the first five and the last are warm-up and shutdown
    assert (m["commit"], m["generation_start"], m["generation_end"], m["batch"]) == pytest.approx(
        (10, 20, 60, 95)
    )
    assert (m["update"], m["push"], m["step"]) == pytest.approx((37, 9, 150))
    assert m["hops"] == pytest.approx(150 - 40 - 37)


def test_generation_held_at_the_replica_for_its_version_starts_at_the_commit() -> None:
    spans = [s for step in range(10) for s in one_step(step)]
    for s in spans:
        if s["name"] == GENERATE and s["end_ns"] % (1000 * MS) == 45 * MS:
            s["start_ns"] -= 80 * MS  # sent ahead: held from 80 ms before its step's commit
    m = medians(step_moments(spans))
    assert (m["generation_start"], m["generation"]) == pytest.approx((10, 50))


def test_a_version_committed_by_its_last_stage_call_is_committed_when_that_call_ends() -> None:
    spans = [s for step in range(10) for s in one_step(step, with_commit=False)]
    for step in range(10):
        stage = span("inference-replica", STAGE, 1000.0 * step + 3, 1000.0 * step + 8)
        spans += [stage, {**stage, "attributes": {"looprl.weight_version": str(step)}}]
    assert medians(step_moments(spans))["commit"] == pytest.approx(8)


def test_a_log_without_complete_steps_says_so() -> None:
    with pytest.raises(ValueError, match="no step has every moment"):
        medians(step_moments(one_step(0, with_commit=False)))


def test_a_step_records_lag_runs_from_its_publish_to_the_gateway_handling_it() -> None:
    def linked(
        service: str, name: str, start_ms: float, end_ms: float, span_id: str, parent: str = ""
    ) -> dict:
        return {**span(service, name, start_ms, end_ms), "span_id": span_id, "parent_span_id": parent}

    spans = [
        # Handled late: the record waited at the gateway until the next step's record came.
        linked("gateway", "looprl.r.train process", 560, 600, "c1", parent="p1"),
        linked("trainer", "looprl.r.train publish", 290, 300, "p1"),
        linked("trainer", "looprl.r.train publish", 10, 12, "p0"),
        linked("gateway", "looprl.r.train process", 14, 40, "c0", parent="p0"),
        # The same names elsewhere are not a record's handling.
        linked("rollout-packer", "looprl.r.train process", 20, 21, "x", parent="p0"),
        linked("gateway", "looprl.r.weights process", 20, 21, "y", parent="p0"),
    ]
    assert record_lags(spans) == pytest.approx([2.0, 260.0])
