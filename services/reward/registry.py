"""Rewards by name: verifiers, reward models, weighted compositions of them, and plugins (the user's
reward functions, services/reward/functions.py), loaded on first use by reference and settings.

Every reward is scored as a composition (a single verifier is a composition of one). Each
component runs under its own timeout; one that times out or raises becomes a failed component
(ok=false, with the reason) and the total counts only the components that succeeded: a broken
verifier is visible in every score it touches, never a silent 0.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from services.kit.usercode import plugins
from services.reward import metrics
from services.reward import verifiers as v
from services.reward.functions import FunctionReward, function_threads, load_function

log = logging.getLogger(__name__)


class UnknownReward(KeyError):
    pass


@dataclass
class Component:
    name: str
    score: float
    weight: float
    ok: bool
    reason: str = ""


@dataclass
class Outcome:
    score: float
    components: list[Component]
    ok: bool
    plugin_error: str = ""  # a plugin's own code failed: the run cannot be scored by it

    def as_dict(self) -> dict[str, float]:
        return {c.name: c.score for c in self.components if c.ok}


@dataclass
class RewardSpec:
    name: str
    kind: str  # "verifier", "model" or "composite"
    description: str
    verifier: v.Verifier | None = None
    parts: list[tuple[str, float]] = field(default_factory=list)


class RewardRegistry:
    def __init__(self, timeout_s: float = 10.0, plugin_dirs: tuple[Path, ...] = ()) -> None:
        self.timeout_s = timeout_s
        self.plugin_dirs = plugin_dirs
        self._specs: dict[str, RewardSpec] = {}
        # Plugins by (reference, settings JSON): one load per process, not per score.
        self._plugins: dict[tuple[str, str], FunctionReward] = {}
        # Each reference's threads, kept across reloads (a call of the version before may still run).
        self._threads: dict[str, ThreadPoolExecutor] = {}

    def add_verifier(self, name: str, verifier: v.Verifier, description: str, kind: str = "verifier") -> None:
        self._specs[name] = RewardSpec(name, kind, description, verifier=verifier)

    def add_composite(self, name: str, parts: list[tuple[str, float]], description: str = "") -> None:
        for part, _ in parts:
            spec = self._specs.get(part)
            if spec is None or spec.kind == "composite":
                raise ValueError(f"rewards.{name}: component {part!r} is not a registered verifier or model")
        self._specs[name] = RewardSpec(name, "composite", description or _describe(parts), parts=list(parts))

    def specs(self) -> list[RewardSpec]:
        return [self._specs[n] for n in sorted(self._specs)]

    def get(self, name: str) -> RewardSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownReward(
                f"reward: unknown reward {name!r}; known: {', '.join(sorted(self._specs))}; or name a "
                "plugin as 'module:function', 'file.py:function' or a looprl.rewards entry point"
            ) from None

    def is_plugin(self, name: str) -> bool:
        return name not in self._specs and (
            plugins.is_reference(name) or name in plugins.entry_point_names(plugins.REWARDS_GROUP)
        )

    def plugin(self, name: str, config_json: str = "", reload: bool = False) -> FunctionReward:
        """The plugin reward `name` with its settings, loaded once (again with `reload`); PluginError or
        BadRewardConfig say why not."""
        key = (name, config_json)
        if reload or key not in self._plugins:
            fn = load_function(name, config_json, self.plugin_dirs)
            fn.threads = self._threads.setdefault(name, function_threads(name))
            self._plugins[key] = fn
        return self._plugins[key]

    async def score(self, name: str, inp: v.ScoreInput, config_json: str = "") -> Outcome:
        if self.is_plugin(name):
            return await self._score_plugin(name, inp, config_json)
        spec = self.get(name)
        parts = spec.parts if spec.kind == "composite" else [(name, 1.0)]
        components = await asyncio.gather(*(self._component(part, weight, inp) for part, weight in parts))
        total = sum(c.score * c.weight for c in components if c.ok)
        return Outcome(total, list(components), all(c.ok for c in components))

    async def _component(self, name: str, weight: float, inp: v.ScoreInput) -> Component:
        verifier = self._specs[name].verifier
        assert verifier is not None
        try:
            score = await asyncio.wait_for(verifier(inp), self.timeout_s)
        except TimeoutError:
            metrics.FAILURES.labels(name, "timeout").inc()
            return Component(name, 0.0, weight, False, f"timed out after {self.timeout_s:g}s")
        except v.VerifierError as exc:
            metrics.FAILURES.labels(name, "rejected").inc()
            return Component(name, 0.0, weight, False, str(exc))
        except Exception as exc:  # a crashing verifier is reported, not propagated
            log.exception("verifier %s crashed", name)
            metrics.FAILURES.labels(name, "crashed").inc()
            return Component(name, 0.0, weight, False, f"crashed: {type(exc).__name__}: {exc}")
        return Component(name, float(score), weight, True)

    async def _score_plugin(self, name: str, inp: v.ScoreInput, config_json: str) -> Outcome:
        try:
            fn = self._plugins.get((name, config_json))
            if fn is None:  # not loaded in this process yet: its import must not stop the event loop
                fn = await asyncio.to_thread(self.plugin, name, config_json)
            score, parts = await fn(inp, self.timeout_s)
        except (plugins.PluginError, ValueError) as exc:
            metrics.FAILURES.labels(name, "crashed").inc()
            reason = str(exc)
            return Outcome(0.0, [Component(name, 0.0, 1.0, False, reason)], False, reason)
        components = [
            Component(name, score, 1.0, True),
            *(Component(k, x, 0.0, True) for k, x in parts.items()),
        ]
        return Outcome(score, components, True)


def _describe(parts: list[tuple[str, float]]) -> str:
    return " + ".join(f"{w:g}*{n}" for n, w in parts)


def default_registry(
    code_executor: v.CodeExecutor | None = None,
    timeout_s: float = 10.0,
    code_timeout_s: float = 5.0,
    plugin_dirs: tuple[Path, ...] = (),
) -> RewardRegistry:
    """The built-in verifiers and the per-environment compositions the recipes name."""
    reg = RewardRegistry(timeout_s, plugin_dirs)
    reg.add_verifier(
        "exact", v.exact_match, "1 if the completion equals task.answer (case/space-insensitive)"
    )
    reg.add_verifier("numeric", v.numeric_equivalence, "1 if the final answer equals task.answer as a number")
    reg.add_verifier("digits_partial", v.digits_partial_credit, "digits right in position + length bonus")
    reg.add_verifier(
        "digits_format", v.digits_format, "1 if the completion is only digits of the right length"
    )
    reg.add_verifier("environment", v.environment_reward, "the environment's own episode reward")
    reg.add_verifier(
        "code_tests", v.make_code_tests(code_executor, code_timeout_s), "pass rate of task.tests"
    )
    reg.add_composite("digits", [("digits_partial", 1.0)], "digits environment: partial credit per digit")
    reg.add_composite("guess", [("environment", 1.0)], "guess environment: found in few turns")
    reg.add_composite("code", [("code_tests", 1.0)], "code environment: tests pass rate in the sandbox")
    reg.add_composite("math", [("numeric", 1.0)], "math environment: final answer equals the reference")
    return reg
