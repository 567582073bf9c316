"""End to end: every service as its own process (real nats-server, Ray head, gRPC), driven through
the gateway exactly as `looprl run` does. The default recipe's learning is asserted with another run
beside it (test_runs_side_by_side.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.runs import assert_accounting, run_to_end, with_overrides
from tests.support.stack import DEFAULT_RECIPE

pytestmark = pytest.mark.slow


def test_async_run_never_trains_staler_than_its_bound(fresh_stack) -> None:
    stack = fresh_stack
    recipe = with_overrides(DEFAULT_RECIPE, run={"steps": 8, "max_staleness": 2})
    run = run_to_end(stack.stub, stack.metadata, recipe, "e2e-async", timeout=300)
    assert_accounting(run)
    assert max(h.max_staleness for h in run.history) <= 2
    assert run.weight_version == 8
    # The packer packs numpy arrays and never needs torch: it starts and runs without loading it.
    packer = stack.state.service("rollout-packer")
    assert "libtorch" not in Path(f"/proc/{packer.pid}/maps").read_text()
