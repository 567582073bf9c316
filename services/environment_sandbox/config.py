"""environment-sandbox service settings (LOOPRL_ENV_<FIELD> or LOOPRL_<FIELD>) and the settings of
its parts: the sandbox pool, the Ray sandbox fleet, the episode worker and the agent loop. A part's
setting is LOOPRL_ENV_<PART>__<FIELD> (e.g. LOOPRL_ENV_SANDBOX__WARM_WORKERS=4) or the whole part as
JSON. Imports nothing heavy."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.environment_sandbox.ratelimit import Limit, LimitError, parse_limits
from services.kit.config.schema import Schema, field_error
from services.kit.config.service import ServiceConfig

IsolationMechanism = Literal[
    "netns", "pidns", "mountns", "ipcns", "utsns", "cgroupns", "rootfs", "cgroup", "seccomp"
]
ALL_ISOLATION: tuple[str, ...] = IsolationMechanism.__args__  # type: ignore[attr-defined]


class WorkspaceConfig(Schema):
    """Repository workspaces (workspace_init.py, workspaces.py): per-episode sandboxes over a
    repository's base layer, kept warm per repository. The limits hold for one episode as a whole:
    every command it runs and every fork it makes."""

    warm_per_repository: int = Field(1, ge=0, le=64)
    """Workspace sandboxes kept started, the repository's base layer mounted, per repository in use."""
    max_warm: int = Field(16, ge=0)
    """Warm workspace sandboxes kept in all (the least recently used repository's go first)."""
    max_workspaces: int = Field(64, ge=1)
    """Live workspaces (episodes and their forks) at once; one more waits for a free slot."""
    disk_bytes: int = Field(256 * 1024 * 1024, ge=1 << 20)
    """What an episode may write to its workspace (the upper layer's tmpfs; counted in its memory)."""
    disk_inodes: int = Field(16384, ge=64)
    """Files and directories an episode may create in its workspace."""
    memory_bytes: int = Field(1024 * 1024 * 1024, ge=16 << 20)
    """Memory of an episode's sandbox, its processes and the workspace it wrote (cgroup)."""
    pids: int = Field(128, ge=8)
    """Processes and threads of an episode's sandbox at once (cgroup)."""
    cpu_quota: float = Field(1.0, ge=0.0)
    """CPUs an episode's sandbox may use at once (cgroup CPU quota); 0: unlimited."""
    cpu_seconds: float = Field(600.0, gt=0.0)
    """CPU time an episode may use in all; a command after that is refused (cgroup v2 accounting)."""
    command_timeout_s: float = Field(30.0, gt=0.0)
    """Default wall clock of one command."""
    max_command_timeout_s: float = Field(300.0, gt=0.0)
    """Longest wall clock a command may ask for."""
    episode_timeout_s: float = Field(1800.0, gt=0.0)
    """Wall clock of an episode from its workspace's start; its workspace is closed after that."""
    max_output_bytes: int = Field(64 * 1024, ge=1024)
    """Output (stdout and stderr together) kept per command."""
    max_layers: int = Field(48, ge=2, le=128)
    """Layers under a workspace (base, frozen forks, hidden tests): bounds how deep forks of forks go."""
    runtime_packages: tuple[str, ...] = ("pytest",)
    """Python distributions (and what they require) copied from the service's environment into the
    read-only runtime commands run with."""

    @model_validator(mode="after")
    def _timeouts(self) -> WorkspaceConfig:
        if self.command_timeout_s > self.max_command_timeout_s:
            raise field_error(
                "command_timeout_s", f"must be <= max_command_timeout_s ({self.max_command_timeout_s})"
            )
        return self


class SandboxConfig(Schema):
    """Limits and pool sizes of sandboxed code execution; a request's timeout and memory may only
    lower the ceilings here."""

    warm_workers: int = Field(2, ge=0)
    """Sandbox workers kept started and waiting."""
    max_concurrency: int = Field(8, ge=1)
    """Sandbox executions at once."""
    timeout_s: float = Field(5.0, gt=0.0)
    """Default wall-clock limit of one execution."""
    max_timeout_s: float = Field(60.0, gt=0.0)
    """Largest timeout a request may ask."""
    memory_bytes: int = Field(512 * 1024 * 1024, ge=1 << 20)
    """Address-space cap of one execution."""
    max_output_bytes: int = Field(1024 * 1024, ge=1)
    """stdout+stderr kept per execution."""
    nproc: int = Field(32, ge=1)
    """RLIMIT_NPROC of a sandbox's uid."""
    fsize_bytes: int = Field(16 * 1024 * 1024, ge=0)
    """Largest file a sandbox may write."""
    nofile: int = Field(64, ge=8)
    """Open files per sandbox process."""
    uid_base: int = Field(600000, ge=1000)
    """First uid of the per-worker uid range (RLIMIT_NPROC is per uid host-wide)."""
    uid_count: int = Field(256, ge=1)
    """Uids in that range."""
    gid: int = Field(65534, ge=0)
    """Group every sandbox runs as."""
    python: str = ""
    """Interpreter the workers run; empty: the service's own."""
    root_dir: str = ""
    """Private root of the sandboxes; empty: a temporary directory."""
    isolation: tuple[IsolationMechanism, ...] = ALL_ISOLATION  # type: ignore[assignment]
    """Isolation mechanisms a sandbox applies."""
    isolation_level: Literal["full", "degraded"] = "full"
    """full: refuse to run code unless every mechanism in `isolation` applies (root with
    CAP_SYS_ADMIN); degraded: run with whatever the host allows (an explicit opt-in, reported per
    execution and in the service's status)."""
    pids: int = Field(64, ge=1)
    """Processes and threads in one sandbox, all together (cgroup)."""
    cpu_quota: float = Field(1.0, ge=0.0)
    """CPUs one sandbox may use (cgroup CPU quota); 0: unlimited."""
    workspace_bytes: int = Field(64 * 1024 * 1024, ge=1 << 20)
    """Size of a sandbox's private /tmp (in memory)."""
    readonly_paths: tuple[str, ...] = ()
    """Host paths shown read-only inside the sandbox besides the interpreter (absolute)."""
    start_timeout_s: float = Field(15.0, gt=0.0)
    """How long a worker may take to start."""
    workspace: WorkspaceConfig = WorkspaceConfig()
    """Repository workspaces for coding agents (their limits are per episode)."""

    @field_validator("readonly_paths")
    @classmethod
    def _absolute(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for i, path in enumerate(paths):
            if not os.path.isabs(path):
                raise field_error(f"[{i}]", f"{path!r} must be an absolute path")
        return paths


class FleetConfig(Schema):
    """The Ray sandbox fleet (sandbox_backend=ray): actors scaled by queue depth."""

    min_actors: int = Field(1, ge=0)
    """Sandbox actors kept."""
    max_actors: int = Field(4, ge=1)
    """Most sandbox actors."""
    target_queue_per_actor: float = Field(4.0, gt=0.0)
    """Executions waiting and running per actor before scaling up."""
    scale_interval_s: float = Field(0.2, gt=0.0)
    """Period of the autoscaler's decisions."""
    scale_down_after_s: float = Field(30.0, ge=0.0)
    """Idle time before an actor is retired."""
    actor_start_timeout_s: float = Field(60.0, gt=0.0)
    """How long an execution waits for a sandbox actor to be placed and started before it fails
    (UNAVAILABLE) instead of hanging on a cluster with no room for one."""

    @model_validator(mode="after")
    def _ordered(self) -> FleetConfig:
        if self.min_actors > self.max_actors:
            raise field_error("max_actors", f"must be >= min_actors ({self.min_actors})")
        return self


class WorkerConfig(Schema):
    """How episode tasks are pulled from the bus and retried."""

    concurrency: int = Field(16, ge=1)
    """Episodes run at once by this process."""
    durable: str = "environment-sandbox"
    """Durable consumer name."""
    ack_wait_s: float = Field(10.0, gt=0.0)
    """Redelivery timer of an unacked task (a running episode heartbeats every third of it)."""
    max_deliver: int = Field(400, ge=1)
    """Deliveries of one task before it is given up (400 is over an hour of retrying)."""
    retry_delay_s: float = Field(0.5, ge=0.0)
    """First delay before a failed episode (a dependency down or restarting) is handed back; it
    doubles per attempt."""
    max_retry_delay_s: float = Field(10.0, ge=0.0)
    """Longest such delay: an outage costs at most this much more than its length."""

    def retry_delay(self, attempt: int) -> float:
        """Delay before redelivering a task that failed on its `attempt`-th delivery (1-based)."""
        return min(self.max_retry_delay_s, self.retry_delay_s * 2 ** max(0, attempt - 1))


class LoopConfig(Schema):
    """The agent loop's bounds on one episode."""

    default_max_tokens: int = Field(32, ge=1)
    """Per-turn max_tokens when a task sets none."""
    max_episode_tokens: int = Field(2048, ge=1)
    """Most tokens (prompt and completions) of one episode."""
    predict_output_lengths: bool = True
    """Send each model turn's predicted output length (GenerateRequest.expected_output_tokens), learned
    per task source from earlier completions, so the router routes it to the deployment whose length
    profile fits; false sends none (the router then routes by max_tokens)."""


class EnvServiceConfig(ServiceConfig):
    router_address: str = ""
    """inference-router gRPC address (episodes)."""
    reward_address: str = ""
    """reward service gRPC address; empty: env reward."""
    tokenizer: str = "char"
    """Tokenizer of episodes whose task names none ('char' or a local directory); a run's tasks name its
    recipe's model.tokenizer."""
    consume_episodes: bool = True
    """Pull episode tasks from the bus."""
    worker: WorkerConfig = WorkerConfig()
    """How episode tasks are pulled and retried."""
    loop: LoopConfig = LoopConfig()
    """The agent loop's bounds."""
    sandbox: SandboxConfig = SandboxConfig()
    """Sandboxed code execution (pool sizes, limits, isolation)."""
    exec_max_code_bytes: int = Field(1 << 20, ge=1)
    """Largest code+files+stdin accepted."""
    max_sessions: int = Field(4096, ge=1)
    """Interactive Reset/Step sessions kept."""
    sandbox_backend: Literal["local", "ray"] = "local"
    """local: a warm sandbox pool in this process; ray: a fleet of sandbox actors on the Ray cluster, scaled
    between fleet.min_actors and fleet.max_actors by queue depth."""
    fleet: FleetConfig = FleetConfig()
    """The Ray sandbox fleet (sandbox_backend=ray)."""
    rate_limits: str = ""
    """JSON {"inference": {"requests_per_s": 50, "tokens_per_s": 5000}}: shared limits per named resource (the
    agent loop reserves 'inference' before each model turn); they win over an environment config's
    rate_limits for the same resource."""
    rate_limiter: Literal["auto", "local", "ray"] = "auto"
    """Where bucket state lives: ray (one named actor every process shares), local (this process only), auto
    (ray when a Ray address is configured, else local)."""
    rate_limit_actor: str = "looprl-rate-limits"
    """Named Ray actor of the buckets."""
    rate_limit_namespace: str = "looprl"
    """Ray namespace of that actor."""
    plugin_dirs: str = ""
    """Directories (':'- or ','-separated) plugin environments and task sources are loaded from: a
    recipe's `file.py:Class` and `module:Class` must lie in one (each is put on sys.path); installed
    packages declaring a looprl entry point need none. Empty: only those packages."""
    data_dirs: str = ""
    """Directories (':'- or ','-separated) a recipe's dataset.path and dataset.eval_path, and the
    repo environment's tasks and repositories, may read (symlinks and '..' resolved; a path outside
    answers as a missing one), besides the plugin directories (and, for repo tasks, the shipped
    configs/data). Empty: only those."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str) -> str:
        if value != "char" and not os.path.isdir(value):
            raise ValueError(f"must be 'char' or a local tokenizer directory, got {value!r}")
        return value

    @field_validator("rate_limits")
    @classmethod
    def _limits_parse(cls, value: str) -> str:
        try:
            parse_limits(value, "")
        except LimitError as exc:
            path, _, message = str(exc).partition(": ")
            raise field_error(path, message) from None
        return value

    @property
    def parsed_rate_limits(self) -> dict[str, Limit]:
        return parse_limits(self.rate_limits, "rate_limits")

    def shared_limits(self, address_from_env: str = "") -> bool:
        """Whether rate-limit state lives in the shared Ray actor (else in this process)."""
        return self.rate_limiter == "ray" or (
            self.rate_limiter == "auto" and bool(self.ray_address or address_from_env)
        )
