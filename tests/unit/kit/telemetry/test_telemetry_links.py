"""A step's span links to the rollouts it trains through their carried traceparents."""

from __future__ import annotations

from services.kit.telemetry import tracing as telemetry

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def carrier(span: str) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE}-{span}-01"}


def test_links_follow_the_carried_traceparents_once_each() -> None:
    carriers = [carrier("00f067aa0ba902b7"), carrier("00f067aa0ba902b8"), carrier("00f067aa0ba902b7")]
    links, dropped = telemetry.link_carriers(carriers)
    assert [format(link.context.span_id, "016x") for link in links] == [
        "00f067aa0ba902b7",
        "00f067aa0ba902b8",
    ]
    assert all(format(link.context.trace_id, "032x") == TRACE for link in links) and dropped == 0


def test_rollouts_without_a_trace_link_to_nothing() -> None:
    links, dropped = telemetry.link_carriers([{"traceparent": ""}, None, {}, {"traceparent": "garbage"}])
    assert links == [] and dropped == 0


def test_links_past_the_limit_are_counted_not_kept() -> None:
    carriers = [carrier(f"{i:016x}") for i in range(1, 6)]
    links, dropped = telemetry.link_carriers(carriers, limit=3)
    assert len(links) == 3 and dropped == 2
