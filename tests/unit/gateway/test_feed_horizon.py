"""How far ahead of its trained version the gateway feeds a run's episodes."""

from __future__ import annotations

from gateway.runs import feed_horizon


def test_a_synchronous_run_feeds_the_next_step_once_the_packer_planned_the_current_one() -> None:
    # Version 3 trained: step 3 (sampling version 3) is fed; step 4 waits for step 3's plan.
    assert feed_horizon(trained=3, planned=2, max_staleness=0) == 3
    assert feed_horizon(trained=3, planned=3, max_staleness=0) == 4
    # Before any plan, only the first step goes out.
    assert feed_horizon(trained=0, planned=-1, max_staleness=0) == 0


def test_a_plan_far_ahead_feeds_no_further_than_one_step_past_the_trained_version() -> None:
    assert feed_horizon(trained=3, planned=390, max_staleness=0) == 4


def test_an_asynchronous_run_feeds_one_step_past_its_staleness_bound_whatever_was_planned() -> None:
    for planned in (-1, 3, 9):
        assert feed_horizon(trained=3, planned=planned, max_staleness=2) == 6
