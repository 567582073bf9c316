"""The environment interface, its typed per-environment config, and the registry by name.

An environment is a text game: `reset(task)` gives the opening chat messages, `step(action)` takes
the model's reply and answers with more messages, a reward contribution, and whether the episode
is over. Environments are async because some (code) wait on the sandbox. One instance serves one
episode; the registry builds instances from a name plus a JSON config, rejecting unknown keys by
name so a typo in a recipe fails loudly instead of silently using a default.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, ValidationError, field_validator

from services.environment_sandbox.ratelimit import Limit, LimitError, parse_limits
from services.kit.config.schema import Schema, explain, field_error
from services.kit.usercode import plugins

Message = dict[str, str]
# Runs code in the sandbox: (code, stdin, files, timeout_s) -> result with .stdout/.exit_code/...
Executor = Callable[..., Awaitable[Any]]


class EnvironmentError_(ValueError):
    """Bad input to an environment (unknown name, malformed task or config); names the field."""


class UnknownEnvironment(EnvironmentError_):
    """No environment of that name is registered."""


@dataclass
class StepResult:
    observation: list[Message]
    reward: float
    done: bool
    info: dict[str, str] = field(default_factory=dict)


@dataclass
class EnvContext:
    """What the host gives environments: the sandbox, when there is one, and the shared rate
    limiter with the limits in force for this episode."""

    executor: Executor | None = None
    limiter: Any = None  # ratelimit.RateLimiter
    limits: dict[str, Any] = field(default_factory=dict)  # resource -> ratelimit.Limit
    # Repository workspaces (sandbox/workspaces.py, or the Ray fleet's): open, run, fork, close.
    workspaces: Any = None

    async def acquire(self, resource: str, requests: float = 1.0, tokens: float = 0.0) -> float:
        """Wait for the resource's rate limit before using it (an external API, the sandbox);
        returns at once for resources no limit names. Environments call this around their
        external calls so every worker of every process shares one budget."""
        if self.limiter is None or resource not in self.limits:
            return 0.0
        return await self.limiter.acquire(resource, requests, tokens)

    def with_limits(self, limits: dict[str, Any]) -> EnvContext:
        return EnvContext(self.executor, self.limiter, {**self.limits, **limits}, self.workspaces)


class EnvConfig(Schema):
    """Settings every environment has (the recipe's `environment.config`, plus `max_turns`, which the
    gateway fills from `environment.max_turns`)."""

    model_config = ConfigDict(strict=True)

    max_turns: int = Field(1, ge=1, le=1024)
    """Most model turns in one episode."""
    max_action_chars: int = Field(4096, ge=1)
    """Longest model reply the environment reads."""
    max_episode_tokens: int = Field(0, ge=0)
    """Most tokens (prompt, model turns and environment turns) of one episode, up to the run's
    deployments' max_model_len; 0: the environment service's loop.max_episode_tokens."""
    rate_limits: dict[str, Limit] = {}
    """Rate-limited resources this environment uses, {"inference": {"requests_per_s": 50}}: the agent
    loop reserves "inference" before each model turn, environments reserve their own resources
    through EnvContext.acquire."""

    @field_validator("rate_limits", mode="before")
    @classmethod
    def _limits(cls, value: Any) -> dict[str, Limit]:
        try:
            return parse_limits(value, "")
        except LimitError as exc:
            path, _, message = str(exc).partition(": ")
            raise field_error(path, message) from None


class Environment(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    multi_turn: ClassVar[bool] = False
    default_reward: ClassVar[str] = ""
    Config: ClassVar[type[EnvConfig]] = EnvConfig

    def __init__(self, config: EnvConfig, context: EnvContext | None = None) -> None:
        self.config = config
        self.context = context or EnvContext()
        self.turns = 0
        self.done = False
        self.task: dict[str, Any] = {}

    @classmethod
    @abstractmethod
    def generate(cls, rng: random.Random, config: EnvConfig) -> dict[str, Any]:
        """One task drawn from the environment's built-in generator."""

    @abstractmethod
    def validate_task(self, task: dict[str, Any]) -> None:
        """Raise EnvironmentError_ naming the field when the task is malformed."""

    @abstractmethod
    async def _reset(self) -> list[Message]: ...

    @abstractmethod
    async def _step(self, action: str) -> StepResult: ...

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if not isinstance(task, dict):
            raise EnvironmentError_("task_json: must be a JSON object")
        self.validate_task(task)
        self.task, self.turns, self.done = task, 0, False
        return await self._reset()

    async def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvironmentError_("action: the episode is already over")
        if len(action) > self.config.max_action_chars:
            raise EnvironmentError_(
                f"action: {len(action)} characters is longer than the limit {self.config.max_action_chars}"
            )
        self.turns += 1
        result = await self._step(action)
        if self.turns >= self.config.max_turns and not result.done:
            result.done = True
            result.info.setdefault("finish", "max_turns")
        self.done = result.done
        return result

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools the model may call (OpenAI function schemas), rendered by the run's chat
        template; None for an environment without tools."""
        return None

    async def end(self, reason: str) -> float:
        """The episode is cut short by the agent loop (`reason`, e.g. its token budget): the reward
        for where it stands (a repository episode runs its hidden tests). Most environments have
        nothing more to give."""
        return 0.0

    async def close(self) -> None:
        """Free what the episode holds (a workspace); the agent loop calls it when the episode ends,
        however it ends."""
        return None

    async def afork(self) -> Environment:
        """`fork` for environments whose copy needs I/O (a repository workspace forks its sandbox)."""
        return self.fork()

    def fork(self) -> Environment:
        """An independent copy at this point of the episode (for branching): its own state,
        the same host context (sandbox, limiter) and the same parsed config, which nothing
        changes after parsing. Environments holding resources that cannot be deep-copied
        override this."""
        return copy.deepcopy(self, {id(self.context): self.context, id(self.config): self.config})


class PluginFailure(EnvironmentError_):
    """A plugin's own code failed during an episode (an environment raised, a reward raised or gave
    no finite number): the run cannot go on, and the episode worker fails it naming the cause."""


_REGISTRY: dict[str, type[Environment]] = {}
# Plugin environments loaded by this process, by the reference a recipe names them by.
_PLUGINS: dict[str, tuple[type[Environment], plugins.Loaded]] = {}
_PLUGIN_DIRS: list[Path] = []


def register(cls: type[Environment]) -> type[Environment]:
    _REGISTRY[cls.name] = cls
    return cls


def set_plugin_dirs(dirs: Sequence[Path]) -> None:
    """The directories plugin environments (and task sources) load from (the service's setting)."""
    _PLUGIN_DIRS[:] = list(dirs)


def plugin_dirs() -> tuple[Path, ...]:
    return tuple(_PLUGIN_DIRS)


def environment_names() -> list[str]:
    return sorted(_REGISTRY)


def _load_plugin(name: str) -> tuple[type[Environment], plugins.Loaded]:
    try:
        loaded = plugins.load(name, plugins.ENVIRONMENTS_GROUP, _PLUGIN_DIRS)
    except plugins.PluginError as exc:
        raise PluginFailure(f"environment.name: plugin {exc}") from None
    cls = loaded.obj
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise PluginFailure(
            f"environment.name: plugin {name!r} ({loaded.origin}) is {plugins.kind_of(cls)}, not a subclass of "
            "services.environment_sandbox.environments.Environment"
        )
    missing = [m for m in ("generate", "validate_task", "_reset", "_step") if m in cls.__abstractmethods__]
    if missing:
        raise PluginFailure(
            f"environment.name: plugin {name!r} ({plugins.call_site(cls) or loaded.origin}) does not "
            f"define {', '.join(missing)}"
        )
    return cls, loaded


def environment_class(name: str, reload: bool = False) -> type[Environment]:
    """A built-in environment by name, else a plugin (import path or `looprl.environments` entry
    point) loaded once per process; `reload` loads a plugin again (a run being created)."""
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    if reload or name not in _PLUGINS:
        if not plugins.is_reference(name) and name not in plugins.entry_point_names(
            plugins.ENVIRONMENTS_GROUP
        ):
            raise UnknownEnvironment(
                f"environment: unknown environment {name!r}; built in: {', '.join(environment_names())}; "
                "or name a plugin as 'module:Class', 'file.py:Class' or a looprl.environments entry point"
            )
        _PLUGINS[name] = _load_plugin(name)
    return _PLUGINS[name][0]


def plugin_of(cls: type[Environment]) -> plugins.Loaded | None:
    """Where a plugin environment class came from; None for a built-in one."""
    for plugin_cls, loaded in _PLUGINS.values():
        if plugin_cls is cls:
            return loaded
    return None


@contextlib.contextmanager
def plugin_code(cls: type[Environment], failed: str) -> Iterator[None]:
    """Around a call into an environment's code: what a plugin environment's own code raises (not an
    EnvironmentError_, its way of refusing input) is a PluginFailure naming the plugin, its file and
    line; SystemExit and KeyboardInterrupt too, which must not end this service."""
    try:
        yield
    except (EnvironmentError_, *plugins.PASSED_THROUGH):
        raise
    except BaseException as exc:
        loaded = plugin_of(cls)
        if loaded is None:
            raise
        raise PluginFailure(
            f"environment.name: plugin {loaded.reference!r} {failed}: {plugins.describe(exc, loaded.root)}"
        ) from None


def parse_config(cls: type[Environment], config_json: str | dict | None) -> EnvConfig:
    """The environment's typed config from JSON; unknown keys, wrong types and values out of bounds
    name the field (environment_config.<field>)."""
    if not config_json:
        raw: Any = {}
    elif isinstance(config_json, dict):
        raw = config_json
    else:
        try:
            raw = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise EnvironmentError_(f"environment_config_json: not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise EnvironmentError_("environment_config_json: must be a JSON object")
    try:
        return cls.Config.model_validate(raw)
    except ValidationError as exc:
        raise EnvironmentError_(f"environment_config.{explain(exc, cls.Config, '')}") from None


def make_environment(
    name: str, config_json: str | dict | None = None, context: EnvContext | None = None
) -> Environment:
    cls = environment_class(name)
    return cls(parse_config(cls, config_json), context)


def parse_task(task_json: str) -> dict[str, Any]:
    try:
        task = json.loads(task_json)
    except json.JSONDecodeError as exc:
        raise EnvironmentError_(f"task_json: not valid JSON: {exc}") from None
    if not isinstance(task, dict):
        raise EnvironmentError_("task_json: must be a JSON object")
    return task
