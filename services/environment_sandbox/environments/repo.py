"""repo: a coding agent in a repository, calling tools, rewarded by tests it cannot see.

Each episode gets its own copy-on-write workspace of the task's repository (sandbox/workspaces.py).
The model calls tools in its chat template's convention (Hermes `<tool_call>` JSON, the schemas
rendered by the template: services/modeling/tool_calls.py); every call runs in the workspace's
sandbox and its result comes back as a `tool` message, cut to `max_observation_chars` with a
marker. A reply with no call, a call that is not JSON, an unknown tool or a bad argument gets an
error the model can read, and the episode goes on.

When the model calls `submit` (or its turns or wall clock run out) the episode is scored in a fresh
fork of the final workspace: only that fork receives the hidden tests (laid over the workspace for
SWE-style tasks, bound at /tests for Harbor-style ones), with the episode's changes to pytest's
configuration files undone, and runs them. The reward is 1.0 when every FAIL_TO_PASS and
PASS_TO_PASS test passes (`reward = "fraction"`: the share that pass), or the Harbor verifier's.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field

from services.environment_sandbox.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentError_,
    Message,
    StepResult,
    register,
)
from services.environment_sandbox.environments.repo_tasks import (
    allowed,
    load_repo_tasks,
    swe_task,
    where_allowed,
)
from services.environment_sandbox.sandbox.job import InvalidJob, SandboxError
from services.kit.telemetry.metrics import counter
from services.modeling.tool_calls import ToolCall, parse_tool_calls

TOOLS_SCRIPT = "/opt/looprl/looprl_tools.py"
# Files that configure pytest: an episode's changes to them are undone before the hidden tests run,
# so a conftest hook cannot mark failing tests passed.
PYTEST_CONFIG_FILES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
TOOL_CALLS = counter("looprl_repo_tool_calls_total")
_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED) (\S+)")


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


_STR = {"type": "string"}
_INT = {"type": "integer"}
TOOLS: dict[str, dict[str, Any]] = {
    "run_shell": _fn(
        "run_shell",
        "Run a bash command in the repository (the current directory). Returns its exit code and output.",
        {"command": {**_STR, "description": "the command"}},
        ["command"],
    ),
    "read_file": _fn(
        "read_file",
        "Show lines of a file with their numbers.",
        {"path": _STR, "start_line": _INT, "end_line": _INT},
        ["path"],
    ),
    "search": _fn(
        "search",
        "Find lines matching a regular expression in the repository's files.",
        {"pattern": _STR, "path": {**_STR, "description": "file or directory, default the repository"}},
        ["pattern"],
    ),
    "write_file": _fn(
        "write_file", "Write a whole file.", {"path": _STR, "content": _STR}, ["path", "content"]
    ),
    "apply_patch": _fn(
        "apply_patch",
        "Apply a unified diff (--- a/path, +++ b/path, @@ hunks) to the repository.",
        {"patch": _STR},
        ["patch"],
    ),
    "run_tests": _fn(
        "run_tests",
        "Run the repository's visible tests with pytest (all, or the given files or test ids).",
        {"paths": {"type": "array", "items": _STR}},
        [],
    ),
    "submit": _fn("submit", "Finish: your changes are tested with tests you cannot see.", {}, []),
}
_TYPES = {"string": str, "integer": int, "array": list}
ToolName = Literal["run_shell", "read_file", "search", "write_file", "apply_patch", "run_tests", "submit"]
SYSTEM_PROMPT = (
    "You are a software engineer working in a git-less checkout of a Python repository. Use the tools "
    "to explore the code, fix the problem the user reports, and call submit when you are done."
)
NO_CALL = (
    "Your reply called no tool. Call one of the tools with "
    '<tool_call>\n{"name": <tool-name>, "arguments": {...}}\n</tool_call>, or call submit when you are done.'
)


@dataclass
class RepoConfig(EnvConfig):
    """A coding agent in a repository (SWE-bench-style JSONL or Harbor-style task directories)."""

    dataset: str = ""
    """SWE-bench-style JSONL over local repositories, or a directory of Harbor-style tasks
    (tools/make_repo_corpus.py writes both; configs/data/repo_corpus is the shipped corpus). A run's
    `[dataset]` section may give SWE-bench rows instead (JSONL or parquet)."""
    repos_root: str = ""
    """Where repositories a row names as "owner/name" (or by a relative path) are checked out
    (owner__name or owner/name); rows from a run's `[dataset]` resolve against it."""
    max_turns: int = Field(20, ge=1, le=1024)
    """Model turns (each may call several tools) before the episode is scored."""
    max_action_chars: int = Field(16384, ge=1)
    """Longest model reply read."""
    max_observation_chars: int = Field(4000, ge=200)
    """Longest tool result shown to the model; longer ones keep their head and tail around a marker."""
    command_timeout_s: float = Field(30.0, gt=0.0)
    """Wall clock of one tool call (capped by the sandbox's workspace.max_command_timeout_s)."""
    episode_timeout_s: float = Field(600.0, gt=0.0)
    """Wall clock of the agent's part of an episode (a Harbor task's agent.timeout_sec wins)."""
    test_timeout_s: float = Field(120.0, gt=0.0)
    """Wall clock of scoring (a Harbor task's verifier.timeout_sec wins)."""
    tools: list[ToolName] = Field(list(get_args(ToolName)), min_length=1)
    """The tools the model is given (submit is always among them)."""
    reward: Literal["resolved", "fraction"] = "resolved"
    """resolved: 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0; fraction: the
    share of them that pass."""
    system_prompt: str = SYSTEM_PROMPT
    """The system turn, before the tools block the chat template adds."""


_ROW_TASKS: dict[str, dict[str, Any]] = {}


def _row_task(row: dict[str, Any], repos_root: str) -> dict[str, Any]:
    """A dataset row as a task, made once per instance (its hidden files come from git or disk)."""
    key = json.dumps([row.get("instance_id"), row.get("repo"), row.get("base_commit"), repos_root])
    if key not in _ROW_TASKS:
        if len(_ROW_TASKS) > 4096:
            _ROW_TASKS.clear()
        _ROW_TASKS[key] = swe_task(row, Path.cwd(), repos_root, "task_json")
    return copy.deepcopy(_ROW_TASKS[key])


@functools.lru_cache(maxsize=8)
def _tasks(dataset: str, repos_root: str) -> tuple[dict[str, Any], ...]:
    if not dataset:
        raise EnvironmentError_(
            "environment.config.dataset: the repo environment needs a task file or directory"
        )
    tasks = load_repo_tasks(dataset, repos_root)
    if not tasks:
        raise EnvironmentError_(f"environment.config.dataset: {dataset!r} holds no tasks")
    return tuple(tasks)


def truncate(text: str, limit: int) -> str:
    """`text`, or its head and tail around a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters truncated ...]\n"
    keep = max(0, limit - len(marker))
    head = keep * 2 // 3
    return text[:head] + marker + text[len(text) - (keep - head) :]


def pytest_outcomes(output: str) -> dict[str, str]:
    """Test id -> PASSED/FAILED/ERROR/... from pytest's `-rA` summary."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        match = _RESULT.match(line.strip())
        if match:
            found.setdefault(match.group(2), match.group(1))
    return found


@register
class RepoEnv(Environment):
    name = "repo"
    description = "Fix a bug in a repository with tool calls; hidden tests decide the reward."
    multi_turn = True
    default_reward = ""
    Config = RepoConfig

    def __init__(self, config: EnvConfig, context: Any = None) -> None:
        super().__init__(config, context)
        self.workspace_id = ""
        self.info: dict[str, str] = {}
        self.calls = self.call_errors = 0

    @classmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        assert isinstance(config, RepoConfig)
        tasks = _tasks(config.dataset, config.repos_root)
        return copy.deepcopy(tasks[rng.randrange(len(tasks))])

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        """A raw SWE-bench row (from the run's `[dataset]` section: JSONL or the published parquet)
        is made a task first, its repo resolved against repos_root or the working directory."""
        if isinstance(task, dict) and "kind" not in task and "FAIL_TO_PASS" in task:
            assert isinstance(self.config, RepoConfig)
            task = await asyncio.to_thread(_row_task, task, self.config.repos_root)
        return await super().reset(task)

    def validate_task(self, task: dict[str, Any]) -> None:
        for key in ("instance_id", "repo", "problem_statement"):
            if not isinstance(task.get(key), str) or not task[key]:
                raise EnvironmentError_(f"task_json.{key}: must be a non-empty string")
        if allowed(task["repo"]) is None:
            raise EnvironmentError_(
                f"task_json.repo: {task['repo']!r} is not a directory or archive{where_allowed()}"
            )
        kind = task.get("kind", "swe")
        if kind == "swe":
            if not isinstance(task.get("FAIL_TO_PASS"), list) or not task["FAIL_TO_PASS"]:
                raise EnvironmentError_("task_json.FAIL_TO_PASS: must be a non-empty list of test ids")
            if not isinstance(task.get("hidden_files", {}), dict):
                raise EnvironmentError_("task_json.hidden_files: must be an object of path -> text")
        elif kind == "harbor":
            if not isinstance(task.get("tests"), dict) or "test.sh" not in task["tests"]:
                raise EnvironmentError_("task_json.tests: must hold test.sh")
        else:
            raise EnvironmentError_(f"task_json.kind: must be 'swe' or 'harbor', got {kind!r}")

    def tool_schemas(self) -> list[dict[str, Any]]:
        assert isinstance(self.config, RepoConfig)
        names = [*dict.fromkeys([*self.config.tools, "submit"])]
        return [TOOLS[name] for name in names]

    @property
    def _workspaces(self) -> Any:
        if self.context.workspaces is None:
            raise EnvironmentError_(
                "environment: 'repo' needs the sandbox's workspaces and none is configured"
            )
        return self.context.workspaces

    async def _reset(self) -> list[Message]:
        assert isinstance(self.config, RepoConfig)
        self.workspace_id = ""  # opened with the first step: rendering the prompt costs nothing
        return [
            {"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": self.task["problem_statement"]},
        ]

    async def _workspace(self) -> str:
        """The episode's workspace, opened on first use (from the repository's warm pool)."""
        if not self.workspace_id:
            assert isinstance(self.config, RepoConfig)
            timeout = self.task.get("agent_timeout_s") or self.config.episode_timeout_s
            try:
                opened = await self._workspaces.open(
                    self.task["repo"], self.task.get("base_commit", ""), timeout
                )
            except InvalidJob as exc:  # the task's repository is missing or unreadable: a bad task
                raise EnvironmentError_(f"task_json.repo: {exc}") from None
            # Any other SandboxError (no sandbox to be had now) propagates: the task is retried, not
            # trained on as a failed episode.
            self.workspace_id = opened["id"]
            self.info = {
                "setup_seconds": f"{opened['setup_seconds']:.6f}",
                "warm": str(opened["warm"]).lower(),
            }
        return self.workspace_id

    async def _step(self, action: str) -> StepResult:
        assert isinstance(self.config, RepoConfig)
        await self._workspace()
        parsed = parse_tool_calls(action)
        if not parsed.attempted:
            self.call_errors += 1
            TOOL_CALLS.labels("no_call").inc()
            return await self._continue_or_score([{"role": "user", "content": NO_CALL}])
        observation = [self._tool_message("", f"error: {error}") for error in parsed.errors]
        self.call_errors += len(parsed.errors)
        TOOL_CALLS.labels("malformed").inc(len(parsed.errors))
        submitted = False
        for call in parsed.calls:
            self.calls += 1
            if call.name == "submit":
                TOOL_CALLS.labels("ok").inc()
                submitted = True
                break
            try:
                content = await self._call(call)
            except SandboxError as exc:  # the wall clock or CPU budget is spent, or the sandbox died
                observation.append(self._tool_message(call.name, f"error: {exc}"))
                return await self._score(observation, "workspace_error")
            observation.append(self._tool_message(call.name, content))
        if submitted:
            return await self._score(observation, "submit")
        return await self._continue_or_score(observation)

    async def _continue_or_score(self, observation: list[Message]) -> StepResult:
        if self.turns >= self.config.max_turns:
            return await self._score(observation, "max_turns")
        return StepResult(observation, 0.0, False, self._info())

    def _tool_message(self, name: str, content: str) -> Message:
        assert isinstance(self.config, RepoConfig)
        message = {"role": "tool", "content": truncate(content, self.config.max_observation_chars)}
        if name:
            message["name"] = name
        return message

    def _info(self) -> dict[str, str]:
        return {**self.info, "tool_calls": str(self.calls), "tool_call_errors": str(self.call_errors)}

    # -- tools ---------------------------------------------------------------------------------------

    def _check_arguments(self, call: ToolCall) -> str:
        """'' when the call fits its tool's schema, else the error the model reads."""
        schemas = {t["function"]["name"]: t["function"] for t in self.tool_schemas()}
        function = schemas.get(call.name)
        if function is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(schemas)}"
        params = function["parameters"]
        for name in params["required"]:
            if name not in call.arguments:
                return f"error: {call.name}: missing argument {name!r}"
        for name, value in call.arguments.items():
            spec = params["properties"].get(name)
            if spec is None:
                return f"error: {call.name}: unknown argument {name!r}; it takes {', '.join(params['properties'])}"
            kind = _TYPES[spec["type"]]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return f"error: {call.name}: argument {name!r} must be a {spec['type']}"
        return ""

    async def _run(self, argv: list[str], stdin: str = "", timeout: float = 0.0) -> dict[str, Any]:
        assert isinstance(self.config, RepoConfig)
        return await self._workspaces.run(
            self.workspace_id, argv, stdin, timeout or self.config.command_timeout_s
        )

    async def _call(self, call: ToolCall) -> str:
        problem = self._check_arguments(call)
        if problem:
            self.call_errors += 1
            TOOL_CALLS.labels("unknown_tool" if "unknown tool" in problem else "bad_arguments").inc()
            return problem
        TOOL_CALLS.labels("ok").inc()
        args = call.arguments
        if call.name == "run_shell":
            return _shell_result(await self._run(["bash", "-c", args["command"]]))
        if call.name == "run_tests":
            paths = [shlex.quote(p) for p in args.get("paths", [])]
            command = f"python -m pytest -q -p no:cacheprovider --tb=short {' '.join(paths)}"
            return _shell_result(await self._run(["bash", "-c", command]))
        # read_file, search, write_file, apply_patch: looprl_tools.py in the sandbox
        result = await self._run(["python", "-I", TOOLS_SCRIPT, call.name], json.dumps(args))
        if result["timed_out"]:
            return "error: the tool timed out"
        return result["output"].rstrip("\n")

    # -- scoring ------------------------------------------------------------------------------------

    async def _score(self, observation: list[Message], finish: str) -> StepResult:
        assert isinstance(self.config, RepoConfig)
        task = self.task
        timeout = task.get("verifier_timeout_s") or self.config.test_timeout_s
        info = {**self._info(), "finish": finish}
        scoring = ""
        try:
            if task.get("kind", "swe") == "harbor":
                fork = await self._workspaces.fork(self.workspace_id, tests=task["tests"], timeout_s=timeout)
                scoring = fork["id"]
                reward = await self._harbor_reward(scoring, timeout, info)
            else:
                fork = await self._workspaces.fork(
                    self.workspace_id,
                    files=task.get("hidden_files") or None,
                    revert=PYTEST_CONFIG_FILES,
                    timeout_s=timeout,
                )
                scoring = fork["id"]
                reward = await self._swe_reward(scoring, timeout, info)
        except SandboxError as exc:
            info["error"] = f"scoring failed: {exc}"
            reward = 0.0
        finally:
            if scoring:
                await self._workspaces.close(scoring)
            await self.close()
        return StepResult(observation, reward, True, info)

    async def _swe_reward(self, workspace: str, timeout: float, info: dict[str, str]) -> float:
        assert isinstance(self.config, RepoConfig)
        f2p, p2p = self.task["FAIL_TO_PASS"], self.task.get("PASS_TO_PASS", [])
        ids = " ".join(shlex.quote(t) for t in dict.fromkeys([*f2p, *p2p]))
        result = await self._workspaces.run(
            workspace, ["bash", "-c", f"{self.task['test_command']} {ids}"], "", timeout
        )
        outcomes = pytest_outcomes(result["output"])
        passed_f2p = sum(outcomes.get(t) == "PASSED" for t in f2p)
        passed_p2p = sum(outcomes.get(t) == "PASSED" for t in p2p)
        info.update({"FAIL_TO_PASS": f"{passed_f2p}/{len(f2p)}", "PASS_TO_PASS": f"{passed_p2p}/{len(p2p)}"})
        if result["timed_out"]:
            info["tests"] = "timed out"
        if self.config.reward == "fraction":
            return (passed_f2p + passed_p2p) / (len(f2p) + len(p2p))
        return float(passed_f2p == len(f2p) and passed_p2p == len(p2p))

    async def _harbor_reward(self, workspace: str, timeout: float, info: dict[str, str]) -> float:
        run = self._workspaces.run
        await run(workspace, ["bash", "-c", "mkdir -p /logs/verifier && bash /tests/test.sh"], "", timeout)
        found = await run(
            workspace,
            ["bash", "-c", "cat /logs/verifier/reward.txt 2>/dev/null || cat /logs/verifier/reward.json"],
            "",
            10.0,
        )
        text = found["output"].strip()
        try:
            value = json.loads(text)
            reward = float(value.get("reward", 0.0) if isinstance(value, dict) else value)
        except (json.JSONDecodeError, TypeError, ValueError):
            info["error"] = "the verifier wrote no reward (/logs/verifier/reward.txt or reward.json)"
            return 0.0
        info["verifier_reward"] = f"{reward:g}"
        return reward

    # -- lifetime -----------------------------------------------------------------------------------

    async def end(self, reason: str) -> float:
        """Cut short (the episode's token budget): its workspace is scored as it stands."""
        if not self.workspace_id:
            return 0.0
        self.done = True
        return (await self._score([], reason)).reward

    async def afork(self) -> RepoEnv:
        """A copy at this point of the episode with a fork of its workspace (before the first step:
        a workspace of its own, opened when it first steps)."""
        twin = copy.copy(self)
        twin.task = copy.deepcopy(self.task)
        twin.info = dict(self.info)
        if self.workspace_id:
            twin.workspace_id = (await self._workspaces.fork(self.workspace_id))["id"]
        return twin

    def fork(self) -> Environment:
        raise EnvironmentError_("environment: 'repo' forks its workspace, which is async: use afork")

    async def close(self) -> None:
        if self.workspace_id:
            workspace, self.workspace_id = self.workspace_id, ""
            await self._workspaces.close(workspace)


def _shell_result(result: dict[str, Any]) -> str:
    head = f"exit code {result['exit_code']}"
    if result["timed_out"]:
        head = f"timed out after {result['wall_seconds']:.0f} s (every process it started was stopped)"
    elif result.get("killed_reason") == "memory":
        head += " (out of memory)"
    return f"{head}\n{result['output']}".rstrip("\n")
