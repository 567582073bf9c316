"""Text environments: the interface, the registry, the built-ins (digits, guess, code, math, repo), datasets."""

from services.environment_sandbox.environments import (  # noqa: F401 - registers
    code,
    digits,
    guess,
    math_word,
    repo,
    single_turn,
)
from services.environment_sandbox.environments.base import (
    EnvConfig,
    EnvContext,
    Environment,
    EnvironmentError_,
    PluginFailure,
    StepResult,
    UnknownEnvironment,
    environment_class,
    environment_names,
    make_environment,
    parse_task,
    plugin_code,
    plugin_dirs,
    plugin_of,
    set_plugin_dirs,
)
from services.environment_sandbox.environments.datasets import generate_tasks, load_jsonl, load_tasks

__all__ = [
    "EnvConfig",
    "EnvContext",
    "Environment",
    "EnvironmentError_",
    "PluginFailure",
    "StepResult",
    "UnknownEnvironment",
    "environment_class",
    "environment_names",
    "generate_tasks",
    "load_jsonl",
    "load_tasks",
    "make_environment",
    "parse_task",
    "plugin_code",
    "plugin_dirs",
    "plugin_of",
    "set_plugin_dirs",
]
