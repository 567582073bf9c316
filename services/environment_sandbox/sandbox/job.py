"""What a sandbox execution is: the pool's configuration, a job, its result, and the errors.

Separate from the pool so the service, the Ray fleet and environments can validate and describe
executions without importing the process machinery.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

ALL_ISOLATION = ("netns", "pidns", "mountns", "ipcns", "utsns", "cgroupns", "rootfs", "cgroup", "seccomp")
ISOLATION_LEVELS = ("full", "degraded")
MAX_FILE_KEY_CHARS = 255


@dataclass
class SandboxConfig:
    """Limits and pool sizes; per-request timeout and memory may only lower the ceilings here."""

    warm_workers: int = 2
    max_concurrency: int = 8
    timeout_s: float = 5.0
    max_timeout_s: float = 60.0
    memory_bytes: int = 512 * 1024 * 1024
    max_output_bytes: int = 1024 * 1024
    nproc: int = 32
    fsize_bytes: int = 16 * 1024 * 1024
    nofile: int = 64
    uid_base: int = 600000
    uid_count: int = 256
    gid: int = 65534
    python: str = sys.executable
    root_dir: str = ""
    isolation: tuple[str, ...] = ALL_ISOLATION
    # "full": refuse to run unless every mechanism in `isolation` applies; "degraded": run with
    # what the host allows (reported per execution and in status()). Only an operator sets it.
    isolation_level: str = "full"
    pids: int = 64  # processes and threads in one sandbox, all together (cgroup)
    cpu_quota: float = 1.0  # CPUs one sandbox may use (cgroup CPU quota); 0: unlimited
    workspace_bytes: int = 64 * 1024 * 1024  # size of the sandbox's private /tmp (tmpfs)
    readonly_paths: tuple[str, ...] = ()  # host paths shown read-only besides the interpreter
    start_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        self.isolation = tuple(self.isolation)
        self.readonly_paths = tuple(self.readonly_paths)
        if self.isolation_level not in ISOLATION_LEVELS:
            raise ValueError(
                f"isolation_level: must be one of {', '.join(ISOLATION_LEVELS)}, got {self.isolation_level!r}"
            )
        unknown = set(self.isolation) - set(ALL_ISOLATION)
        if unknown:
            raise ValueError(f"isolation: unknown mechanisms {sorted(unknown)}")
        for path in self.readonly_paths:
            if not os.path.isabs(path):
                raise ValueError(f"readonly_paths: {path!r} must be an absolute path")


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
