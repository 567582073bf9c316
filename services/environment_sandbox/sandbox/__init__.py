"""Sandboxed execution of untrusted Python: isolated one-shot workers kept warm in a pool."""

from services.environment_sandbox.sandbox.pool import (
    ExecJob,
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxPool,
)

__all__ = ["ExecJob", "ExecResult", "SandboxConfig", "SandboxError", "SandboxPool"]
