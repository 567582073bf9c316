"""Text environments: the interface, the registry, the built-ins (digits, guess, code), datasets."""

from services.environment_sandbox.environments import code, digits, guess, math_word  # noqa: F401 - registers
from services.environment_sandbox.environments.base import (
    EnvConfig,
    EnvContext,
    Environment,
    EnvironmentError_,
    StepResult,
    UnknownEnvironment,
    environment_class,
    environment_names,
    make_environment,
    parse_task,
)
from services.environment_sandbox.environments.datasets import generate_tasks, load_jsonl, load_tasks

__all__ = [
    "EnvConfig",
    "EnvContext",
    "Environment",
    "EnvironmentError_",
    "StepResult",
    "UnknownEnvironment",
    "environment_class",
    "environment_names",
    "generate_tasks",
    "load_jsonl",
    "load_tasks",
    "make_environment",
    "parse_task",
]
