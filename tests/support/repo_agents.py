"""Scripted coding agents for the `repo` environment: each reply is text in the model's tool-call
format (Hermes `<tool_call>` JSON), exactly what a model would sample, so the tests exercise the
parser, the tools, the workspace and the scoring the way a run does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.environment_sandbox.environments import EnvContext, make_environment
from services.environment_sandbox.environments.base import StepResult

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "configs" / "data" / "repo_corpus"


def call(name: str, **arguments: Any) -> str:
    """One tool call as Qwen-family models write it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def oracle(task: dict) -> list[str]:
    """Applies the known fix through the tools and submits."""
    if task.get("kind") == "harbor":
        return [
            call("write_file", path="/tmp/solve.sh", content=task["solution"]),
            call("run_shell", command="bash /tmp/solve.sh"),
            call("submit"),
        ]
    return [
        call("search", pattern="def "),
        call("apply_patch", patch=task["patch"]) + call("run_tests"),
        call("submit"),
    ]


def noop(task: dict) -> list[str]:
    return [call("submit")]


async def play(
    workspaces: Any, task: dict, agent: Callable[[dict], list[str]], config: dict | None = None
) -> tuple[StepResult, list[StepResult]]:
    """One episode of the scripted agent; the final step and every step."""
    env = make_environment("repo", {"max_turns": 8, **(config or {})}, EnvContext(workspaces=workspaces))
    try:
        await env.reset(task)
        steps = []
        for reply in agent(task):
            steps.append(await env.step(reply))
            if steps[-1].done:
                return steps[-1], steps
        raise AssertionError(f"{task['instance_id']}: the episode did not end after the agent's replies")
    finally:
        await env.close()


def tool_outputs(steps: list[StepResult]) -> list[str]:
    return [m["content"] for step in steps for m in step.observation]
