"""Rewards from the user's own code: a plain function, as verl's custom reward function,

    def score(prompt, completion, answer, **metadata) -> float | dict

named by a recipe's `reward.function` (`module:score`, `rewards.py:score`, or a `looprl.rewards`
entry point) and loaded by this service (services/kit/usercode/plugins.py says from where). `prompt` is the
task's prompt text (its chat messages for a chat row), `answer` its reference answer (None without
one), and the keyword arguments are the task's metadata; a function naming `task`, `transcript`,
`environment_reward` or `rollout_id` as parameters gets those too. A dict result holds the reward as
"score" and other named numbers, reported as components.

The recipe's `reward.config` is passed as keyword arguments: each key must be a parameter the
function declares, and its value must fit the parameter's annotation (checked when the run is
created). A function that raises, returns NaN, inf or something that is not a number is a plugin
error: the run cannot be scored by it, and fails naming the plugin, its file and line.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from services.kit.usercode import plugins
from services.reward.verifiers import ScoreInput

POSITIONAL = ("prompt", "completion", "answer")
# Passed only to a function that names them: they are not the task's metadata.
EXTRAS = ("task", "transcript", "environment_reward", "rollout_id")


class BadRewardConfig(ValueError):
    """reward.config does not fit the function's parameters; the message names the key."""


# Threads a plain (not async) reward function's calls run on at once. Each function has its own: a
# call that never returns keeps its thread, and only that function's calls may then wait for one.
THREADS_PER_FUNCTION = 8


def function_threads(reference: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(THREADS_PER_FUNCTION, thread_name_prefix=f"reward {reference}")


@dataclass
class FunctionReward:
    reference: str
    loaded: plugins.Loaded
    config: dict[str, Any]
    named: frozenset[str]
    any_keyword: bool
    calls: int = field(default=0)
    threads: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def fn(self) -> Callable[..., Any]:
        return self.loaded.obj

    def _kwargs(self, inp: ScoreInput) -> dict[str, Any]:
        task = inp.task
        metadata = task.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {k: v for k, v in task.items() if k not in ("prompt", "messages", "answer")}
        extras = {
            "task": task,
            "transcript": inp.transcript,
            "environment_reward": inp.environment_reward,
            "rollout_id": inp.rollout_id,
        }
        kwargs = {
            k: v
            for k, v in metadata.items()
            if k not in POSITIONAL and k not in EXTRAS and (self.any_keyword or k in self.named)
        }
        kwargs.update({k: v for k, v in extras.items() if k in self.named})
        kwargs.update(self.config)
        return kwargs

    async def __call__(self, inp: ScoreInput, timeout_s: float) -> tuple[float, dict[str, float]]:
        """(score, named components); PluginError when the function's code fails."""
        task = inp.task
        prompt = task.get("prompt") if isinstance(task.get("prompt"), str) else task.get("messages", "")
        args = (prompt, inp.completion, task.get("answer"))
        kwargs = self._kwargs(inp)
        try:
            # Contained: SystemExit from a plugin ends its call, never this service's event loop.
            if inspect.iscoroutinefunction(self.fn):
                call = plugins.await_contained(self.fn(*args, **kwargs))
            else:
                if self.threads is None:
                    self.threads = function_threads(self.reference)
                context = contextvars.copy_context()  # as asyncio.to_thread: the caller's trace
                work = functools.partial(context.run, plugins.call_contained, self.fn, *args, **kwargs)
                call = asyncio.get_running_loop().run_in_executor(self.threads, work)
            result = await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise plugins.PluginError(
                f"{self.reference!r} ({self.loaded.origin}) did not return within {timeout_s:g}s"
            ) from None
        except Exception as exc:
            raise plugins.PluginError(
                f"{self.reference!r} raised: {plugins.describe(exc, self.loaded.root)}"
            ) from None
        self.calls += 1
        return self._checked(result)

    def _checked(self, result: Any) -> tuple[float, dict[str, float]]:
        site = plugins.call_site(self.fn) or self.loaded.origin
        if isinstance(result, dict):
            if "score" not in result:
                raise plugins.PluginError(
                    f"{self.reference!r} ({site}) returned a dict without 'score' (keys: {', '.join(map(str, result))})"
                )
            components = {str(k): _number(v, f"[{k!r}]", self.reference, site) for k, v in result.items()}
            return components.pop("score"), components
        return _number(result, "", self.reference, site), {}


def _number(value: Any, where: str, reference: str, site: str) -> float:
    """A result as a finite float: numbers, bools and numpy/torch scalars; a string or anything else
    that is not a number is the plugin's error."""
    number = None
    if not isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    if number is None:
        raise plugins.PluginError(
            f"{reference!r} ({site}) returned{where} {value!r} ({type(value).__name__}), not a number "
            "(a reward returns a float or a dict with 'score')"
        )
    if not math.isfinite(number):
        raise plugins.PluginError(f"{reference!r} ({site}) returned{where} {number}, not a finite number")
    return number


def _signature(fn: Any, reference: str, site: str) -> tuple[frozenset[str], bool]:
    """(parameters the function accepts by keyword, whether it takes **kwargs); PluginError when it
    cannot take (prompt, completion, answer)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset(), True
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise plugins.PluginError(
            f"{reference!r} ({site}) takes ({', '.join(p.name for p in params)}); a reward is called as "
            "score(prompt, completion, answer, **metadata)"
        )
    named = frozenset(
        p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ) | frozenset(p.name for p in params if p.kind == p.KEYWORD_ONLY)
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def validate_config(
    fn: Any, config: dict[str, Any], named: frozenset[str], any_keyword: bool
) -> dict[str, Any]:
    """reward.config checked against the function's own parameters and their annotations."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    out = {}
    for key, value in config.items():
        if key in POSITIONAL or key in EXTRAS:
            raise BadRewardConfig(f"reward.config.{key}: set by looprl for every call, not a setting")
        if key not in named:
            known = ", ".join(sorted(named - set(EXTRAS))) or "none"
            raise BadRewardConfig(
                f"reward.config.{key}: the function has no such parameter (its settings: {known})"
            )
        parameter = parameters.get(key)
        annotation = parameter.annotation if parameter is not None else inspect.Parameter.empty
        if annotation is not inspect.Parameter.empty and not isinstance(annotation, str):
            try:
                value = TypeAdapter(annotation).validate_python(value, strict=False)
            except ValidationError as exc:
                message = exc.errors()[0]["msg"]
                raise BadRewardConfig(
                    f"reward.config.{key}: {message} (annotated {annotation!r}), got {value!r}"
                ) from None
            except Exception:  # an annotation pydantic cannot check: taken as given
                pass
        out[key] = value
    return out


def load_function(reference: str, config_json: str, dirs: Sequence[Path]) -> FunctionReward:
    """The reward function `reference` names, with its config checked; PluginError or BadRewardConfig."""
    loaded = plugins.load(reference, plugins.REWARDS_GROUP, dirs)
    site = plugins.call_site(loaded.obj) or loaded.origin
    if inspect.isclass(loaded.obj) or not callable(loaded.obj):
        raise plugins.PluginError(
            f"{reference!r} ({site}) is {plugins.kind_of(loaded.obj)}, not a function "
            "score(prompt, completion, answer, **metadata)"
        )
    named, any_keyword = _signature(loaded.obj, reference, site)
    try:
        config = json.loads(config_json) if config_json else {}
    except json.JSONDecodeError as exc:
        raise BadRewardConfig(f"reward.config: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadRewardConfig("reward.config: must be a table")
    try:
        parameters = inspect.signature(loaded.obj).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    required = [
        p.name
        for p in parameters
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in config
    ]
    if required:
        raise BadRewardConfig(
            f"reward.config.{required[0]}: required by {site} (a parameter without a default)"
        )
    return FunctionReward(
        reference, loaded, validate_config(loaded.obj, config, named, any_keyword), named, any_keyword
    )
