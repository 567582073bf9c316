"""configs/repo_agent_grpo.toml on a local stack, as a user runs it: the default tiny model trains for
its steps on the shipped corpus, every episode in a workspace sandbox of its own whose hidden tests
run when it is scored, and the environment service's metrics show it (workspace setups and forks,
commands).
The tiny model is untrained: it earns no reward, and that is not what is checked."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.runs import assert_accounting, run_to_end
from tests.support.stack import ROOT

pytestmark = pytest.mark.slow
RECIPE = (ROOT / "configs" / "repo_agent_grpo.toml").read_text()


def _metrics(port: int) -> dict[str, float]:
    """Sample name{labels} -> value of one service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_the_repo_agent_recipe_trains_its_steps_with_real_workspaces(fresh_stack) -> None:
    stack = fresh_stack
    run = run_to_end(stack.stub, stack.metadata, RECIPE, "e2e-repo-agent", timeout=600)
    assert run.total_steps == 3 and [h.step for h in run.history] == [0, 1, 2]
    assert_accounting(run)
    metrics = _metrics(stack.state.service("environment-sandbox").metrics_port)
    setups = sum(v for k, v in metrics.items() if k.startswith("looprl_workspace_setup_seconds_count"))
    forks = metrics["looprl_workspace_fork_seconds_count{}"]
    commands = sum(v for k, v in metrics.items() if k.startswith("looprl_workspace_commands_total"))
    # One workspace per episode (a group's samples branch from one prompt before any step, so each
    # opens its own from the warm pool), each scored in a fork of its own running its hidden tests.
    episodes = run.episodes_published
    assert episodes == 3 * 8 and setups == episodes
    assert forks == episodes and commands >= episodes
    assert metrics["looprl_workspaces{}"] == 0  # every workspace closed with its episode
    # Every model turn's reply went through the tool-call parser; the untrained model's replies call
    # nothing well-formed, and each got the readable error instead of ending the episode.
    calls = {k: v for k, v in metrics.items() if k.startswith("looprl_repo_tool_calls_total")}
    assert sum(calls.values()) >= episodes
