"""What a sandbox execution is: the pool's configuration, a job, its result, and the errors.

Separate from the pool so the service, the Ray fleet and environments can validate and describe
executions without importing the process machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.environment_sandbox.config import ALL_ISOLATION, SandboxConfig

__all__ = [
    "ALL_ISOLATION",
    "SandboxConfig",
]  # the pool's configuration, with the rest of what an execution is

MAX_FILE_KEY_CHARS = 255


@dataclass
class ExecJob:
    code: str
    stdin: str = ""
    files: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 0.0
    memory_bytes: int = 0


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str = ""
    wall_seconds: float = 0.0
    output_truncated: bool = False
    isolation: list[str] = field(default_factory=list)
    missing_isolation: list[str] = field(default_factory=list)
    warm: bool = True
    memory_peak_bytes: int = 0  # the sandbox's peak memory, all its processes together (cgroup)
    cpu_throttled_seconds: float = 0.0  # time the CPU quota held the sandbox back (cgroup)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class SandboxError(RuntimeError):
    """A worker could not be started (the sandbox itself is broken, not the user's code)."""


class SandboxUnavailable(SandboxError):
    """The isolation the pool is configured for is not available on this host."""


class InvalidJob(ValueError):
    """A job the sandbox refuses before running anything (the message names the field)."""


def validate_files(files: dict[str, str]) -> None:
    """Each key must be a plain relative file path inside the workspace."""
    keys = set(files)
    for key in files:
        where = f"files[{key!r}]"
        if not isinstance(key, str) or not key:
            raise InvalidJob(f"{where}: must be a non-empty relative path")
        if "\0" in key:
            raise InvalidJob(f"{where}: contains a NUL character")
        if len(key) > MAX_FILE_KEY_CHARS:
            raise InvalidJob(f"{where}: longer than {MAX_FILE_KEY_CHARS} characters")
        if key.startswith("/"):
            raise InvalidJob(f"{where}: must be relative, not absolute")
        parts = key.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise InvalidJob(f"{where}: must name a file (no empty, '.' or '..' parts, no trailing '/')")
        if key == "main.py":
            raise InvalidJob(f"{where}: reserved for the program itself")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in keys:
                raise InvalidJob(f"{where}: {'/'.join(parts[:i])!r} is also given as a file")
        if not isinstance(files[key], str):
            raise InvalidJob(f"{where}: content must be a string")
