"""environment-sandbox service settings (LOOPRL_ENV_<FIELD> or LOOPRL_<FIELD>)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.kit.config import ConfigError, ServiceConfig

SANDBOX_BACKENDS = ("local", "ray")
RATE_LIMITERS = ("auto", "local", "ray")


@dataclass
class EnvServiceConfig(ServiceConfig):
    router_address: str = field(default="", metadata={"help": "inference-router gRPC address (episodes)."})
    reward_address: str = field(
        default="", metadata={"help": "reward service gRPC address; empty: env reward."}
    )
    tokenizer: str = field(
        default="char",
        metadata={
            "help": "Tokenizer of episodes whose task names none ('char' or a local directory); a run's "
            "tasks name its recipe's model.tokenizer."
        },
    )
    consume_episodes: bool = field(default=True, metadata={"help": "Pull episode tasks from the bus."})
    concurrency: int = field(default=16, metadata={"help": "Episodes run at once by this process."})
    durable: str = field(default="environment-sandbox", metadata={"help": "Durable consumer name."})
    ack_wait_s: float = field(
        default=10.0,
        metadata={
            "help": "Redelivery timer of an unacked task (a running episode heartbeats every third of it)."
        },
    )
    max_tokens: int = field(default=32, metadata={"help": "Per-turn max_tokens when a task sets none."})
    warm_workers: int = field(default=2, metadata={"help": "Sandbox workers kept started and waiting."})
    max_exec_concurrency: int = field(default=8, metadata={"help": "Sandbox executions at once."})
    exec_timeout_s: float = field(default=5.0, metadata={"help": "Default sandbox wall-clock limit."})
    exec_max_timeout_s: float = field(default=60.0, metadata={"help": "Largest timeout a request may ask."})
    exec_memory_bytes: int = field(default=512 * 1024 * 1024, metadata={"help": "Sandbox address-space cap."})
    exec_max_output_bytes: int = field(default=1 << 20, metadata={"help": "stdout+stderr kept per run."})
    exec_max_code_bytes: int = field(default=1 << 20, metadata={"help": "Largest code+files+stdin accepted."})
    sandbox_uid_base: int = field(default=600000, metadata={"help": "First uid of the per-worker uid range."})
    sandbox_isolation_level: str = field(
        default="full",
        metadata={
            "help": "full: refuse to run code unless namespaces, private root, cgroup and seccomp all apply "
            "(root with CAP_SYS_ADMIN); degraded: run with whatever the host allows (an explicit opt-in)."
        },
    )
    exec_pids: int = field(default=64, metadata={"help": "Processes+threads per sandbox, all together."})
    exec_cpu_quota: float = field(default=1.0, metadata={"help": "CPUs one sandbox may use; 0: unlimited."})
    exec_workspace_bytes: int = field(
        default=64 * 1024 * 1024, metadata={"help": "Size of a sandbox's private /tmp (in memory)."}
    )
    sandbox_readonly_paths: str = field(
        default="", metadata={"help": "Comma-separated host paths shown read-only inside the sandbox."}
    )
    max_sessions: int = field(default=4096, metadata={"help": "Interactive Reset/Step sessions kept."})
    sandbox_backend: str = field(
        default="local",
        metadata={
            "help": "local: a warm sandbox pool in this process; ray: a fleet of sandbox actors on the "
            "Ray cluster, scaled between sandbox_min_actors and sandbox_max_actors by queue depth."
        },
    )
    sandbox_min_actors: int = field(default=1, metadata={"help": "ray backend: sandbox actors kept."})
    sandbox_max_actors: int = field(default=4, metadata={"help": "ray backend: most sandbox actors."})
    sandbox_queue_per_actor: float = field(
        default=4.0, metadata={"help": "ray backend: executions waiting+running per actor before scaling up."}
    )
    sandbox_scale_down_after_s: float = field(
        default=30.0, metadata={"help": "ray backend: idle time before an actor is retired."}
    )
    rate_limits: str = field(
        default="",
        metadata={
            "help": 'JSON {"inference": {"requests_per_s": 50, "tokens_per_s": 5000}}: shared limits per '
            "named resource (the agent loop reserves 'inference' before each model turn); they win over "
            "an environment config's rate_limits for the same resource."
        },
    )
    rate_limiter: str = field(
        default="auto",
        metadata={
            "help": "Where bucket state lives: ray (one named actor every process shares), local (this "
            "process only), auto (ray when a Ray address is configured, else local)."
        },
    )
    rate_limit_actor: str = field(
        default="looprl-rate-limits", metadata={"help": "Named Ray actor of the buckets."}
    )
    rate_limit_namespace: str = field(default="looprl", metadata={"help": "Ray namespace of that actor."})

    def __post_init__(self) -> None:
        if self.tokenizer != "char" and not os.path.isdir(self.tokenizer):
            raise ConfigError(
                f"LOOPRL_ENV_TOKENIZER: must be 'char' or a local tokenizer directory, got {self.tokenizer!r}"
            )
        if self.sandbox_backend not in SANDBOX_BACKENDS:
            raise ConfigError(
                f"LOOPRL_ENV_SANDBOX_BACKEND: must be one of {', '.join(SANDBOX_BACKENDS)}, got {self.sandbox_backend!r}"
            )
        if self.sandbox_isolation_level not in ("full", "degraded"):
            raise ConfigError(
                "LOOPRL_ENV_SANDBOX_ISOLATION_LEVEL: must be full or degraded, "
                f"got {self.sandbox_isolation_level!r}"
            )
        self.readonly_paths = tuple(p.strip() for p in self.sandbox_readonly_paths.split(",") if p.strip())
        for path in self.readonly_paths:
            if not path.startswith("/"):
                raise ConfigError(f"LOOPRL_ENV_SANDBOX_READONLY_PATHS: {path!r} must be an absolute path")
        if self.rate_limiter not in RATE_LIMITERS:
            raise ConfigError(
                f"LOOPRL_ENV_RATE_LIMITER: must be one of {', '.join(RATE_LIMITERS)}, got {self.rate_limiter!r}"
            )
        if not 0 <= self.sandbox_min_actors <= self.sandbox_max_actors or self.sandbox_max_actors < 1:
            raise ConfigError(
                "LOOPRL_ENV_SANDBOX_MIN_ACTORS/MAX_ACTORS: need 0 <= min <= max and max >= 1, got "
                f"{self.sandbox_min_actors}/{self.sandbox_max_actors}"
            )
        from services.environment_sandbox.ratelimit import LimitError, parse_limits

        try:
            self.parsed_rate_limits = parse_limits(self.rate_limits, "LOOPRL_ENV_RATE_LIMITS")
        except LimitError as exc:
            raise ConfigError(str(exc)) from None

    def shared_limits(self, address_from_env: str = "") -> bool:
        """Whether rate-limit state lives in the shared Ray actor (else in this process)."""
        return self.rate_limiter == "ray" or (
            self.rate_limiter == "auto" and bool(self.ray_address or address_from_env)
        )
