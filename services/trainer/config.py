"""Configuration of the trainer process (env vars LOOPRL_TRAINER_<FIELD> / LOOPRL_<FIELD>).

What a run decides (model, algorithm, optimizer, world size, steps, checkpoint cadence) comes from
its recipe; these are the process's own settings. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ConfigError, ServiceConfig


@dataclass
class TrainerConfig(ServiceConfig):
    packer_address: str = field(
        default="127.0.0.1:50061", metadata={"help": "RolloutPackerService host:port."}
    )
    weight_sync_address: str = field(
        default="", metadata={"help": "WeightSyncService host:port; empty trains without publishing weights."}
    )
    run_ids: str = field(default="", metadata={"help": "Run id to train with `recipe` (no gateway needed)."})
    recipe: str = field(default="", metadata={"help": "Path to the run recipe (TOML) used with `run_ids`."})
    watch_runs: bool = field(
        default=True, metadata={"help": "Train the first active run recorded in the KV bucket 'runs'."}
    )
    checkpoint_dir: str = field(
        default="", metadata={"help": "Checkpoint root; empty uses <state_dir>/trainer. One folder per run."}
    )
    checkpoint_every: int = field(
        default=-1,
        metadata={"help": "Checkpoint every k steps; -1 takes trainer.checkpoint_every from the recipe."},
    )
    keep_checkpoints: int = field(default=3, metadata={"help": "Newest checkpoints kept per run."})
    ack_policy: str = field(
        default="checkpoint",
        metadata={
            "help": "When to AckStep: 'checkpoint' (after the checkpoint covering the step, so a crash "
            "re-trains exactly what the checkpoint lacks) or 'step' (after every step)."
        },
    )
    next_batch_timeout_s: float = field(
        default=5.0, metadata={"help": "NextBatch wait per attempt; the trainer retries until stopped."}
    )
    push_retry_s: float = field(
        default=300.0,
        metadata={
            "help": "How long a failed weight push is retried (backoff 0.5 s doubling to 10 s) "
            "before the run fails; covers a weight-sync restart."
        },
    )
    rank_recoveries: int = field(
        default=3,
        metadata={
            "help": "Times a run's ranks are recreated from its last checkpoint after one is lost "
            "(its process killed, its node gone) before the run fails."
        },
    )
    num_cpus_per_rank: float = field(default=0.5, metadata={"help": "Ray CPUs reserved per rank."})
    threads_per_rank: int = field(default=1, metadata={"help": "torch threads per rank."})
    placement_strategy: str = field(default="PACK", metadata={"help": "Ray placement strategy of the ranks."})
    export_hf_at_end: bool = field(
        default=True, metadata={"help": "Write a Hugging Face safetensors copy when the run completes."}
    )
    grace_seconds: float = field(
        default=120.0, metadata={"help": "On SIGTERM, time for the current step and a final checkpoint."}
    )

    def __post_init__(self) -> None:
        if self.ack_policy not in ("checkpoint", "step"):
            raise ConfigError(
                f"LOOPRL_TRAINER_ACK_POLICY: must be 'checkpoint' or 'step', got {self.ack_policy!r}"
            )
        if self.rank_recoveries < 0:
            raise ConfigError(f"LOOPRL_TRAINER_RANK_RECOVERIES: must be >= 0, got {self.rank_recoveries}")
        if self.push_retry_s <= 0:
            raise ConfigError(f"LOOPRL_TRAINER_PUSH_RETRY_S: must be > 0, got {self.push_retry_s}")
