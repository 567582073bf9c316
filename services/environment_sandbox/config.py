"""environment-sandbox service settings (LOOPRL_ENV_<FIELD> or LOOPRL_<FIELD>)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ServiceConfig


@dataclass
class EnvServiceConfig(ServiceConfig):
    router_address: str = field(default="", metadata={"help": "inference-router gRPC address (episodes)."})
    reward_address: str = field(
        default="", metadata={"help": "reward service gRPC address; empty: env reward."}
    )
    tokenizer: str = field(default="char", metadata={"help": "Tokenizer name or local path (chat template)."})
    consume_episodes: bool = field(default=True, metadata={"help": "Pull episode tasks from the bus."})
    concurrency: int = field(default=16, metadata={"help": "Episodes run at once by this process."})
    durable: str = field(default="environment-sandbox", metadata={"help": "Durable consumer name."})
    ack_wait_s: float = field(default=30.0, metadata={"help": "Redelivery timer of an unacked task."})
    max_tokens: int = field(default=32, metadata={"help": "Per-turn max_tokens when a task sets none."})
    warm_workers: int = field(default=2, metadata={"help": "Sandbox workers kept started and waiting."})
    max_exec_concurrency: int = field(default=8, metadata={"help": "Sandbox executions at once."})
    exec_timeout_s: float = field(default=5.0, metadata={"help": "Default sandbox wall-clock limit."})
    exec_max_timeout_s: float = field(default=60.0, metadata={"help": "Largest timeout a request may ask."})
    exec_memory_bytes: int = field(default=512 * 1024 * 1024, metadata={"help": "Sandbox address-space cap."})
    exec_max_output_bytes: int = field(default=1 << 20, metadata={"help": "stdout+stderr kept per run."})
    exec_max_code_bytes: int = field(default=1 << 20, metadata={"help": "Largest code+files+stdin accepted."})
    sandbox_uid_base: int = field(default=600000, metadata={"help": "First uid of the per-worker uid range."})
    max_sessions: int = field(default=4096, metadata={"help": "Interactive Reset/Step sessions kept."})
