"""Sandboxed execution of untrusted Python: isolated one-shot workers kept warm in a pool."""

from services.environment_sandbox.sandbox.job import (
    ExecJob,
    ExecResult,
    InvalidJob,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
)
from services.environment_sandbox.sandbox.pool import SandboxPool

__all__ = [
    "ExecJob",
    "ExecResult",
    "InvalidJob",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxUnavailable",
]
