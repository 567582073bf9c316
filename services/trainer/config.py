"""Configuration of the trainer process (env vars LOOPRL_TRAINER_<FIELD> / LOOPRL_<FIELD>).

What a run decides (model, algorithm, optimizer, world size, steps, checkpoint cadence) comes from
its recipe; these are the process's own settings. Imports nothing heavy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.kit.config.service import ServiceConfig


class TrainerConfig(ServiceConfig):
    packer_address: str = "127.0.0.1:50061"
    """RolloutPackerService host:port."""
    weight_sync_address: str = ""
    """WeightSyncService host:port; empty trains without publishing weights."""
    run_ids: str = ""
    """Run id to train with `recipe` (no gateway needed)."""
    recipe: str = ""
    """Path to the run recipe (TOML) used with `run_ids`."""
    watch_runs: bool = True
    """Train every active (pending, running or stalled) run recorded in the KV bucket 'runs', each
    with its own ranks."""
    checkpoint_dir: str = ""
    """Checkpoint root; empty uses <state_dir>/trainer. One folder per run."""
    checkpoint_every: int = Field(-1, ge=-1)
    """Checkpoint every k steps; -1 takes trainer.checkpoint_every from the recipe."""
    keep_checkpoints: int = Field(3, ge=1)
    """Newest checkpoints kept per run."""
    ack_policy: Literal["checkpoint", "step"] = "checkpoint"
    """When to AckStep: 'checkpoint' (after the checkpoint covering the step, so a crash re-trains exactly
    what the checkpoint lacks) or 'step' (after every step)."""
    next_batch_timeout_s: float = Field(5.0, gt=0.0)
    """NextBatch wait per attempt; the trainer retries until stopped."""
    push_retry_s: float = Field(300.0, gt=0.0)
    """How long a failed weight push is retried (backoff 0.5 s doubling to 10 s) before the run fails; covers
    a weight-sync restart."""
    rank_recoveries: int = Field(3, ge=0)
    """Times a run's ranks are recreated from its last checkpoint after one is lost (its process killed, its
    node gone) before the run fails."""
    threads_per_rank: int = Field(1, ge=1)
    """torch threads per rank."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy of the ranks."""
    export_hf_at_end: bool = True
    """Write a Hugging Face safetensors copy when the run completes."""
    keep_eval_exports: int = Field(3, ge=0)
    """A run with eval.every exports the weights of each step it evaluates (every k-th, the last; step
    0 is its initial model) as it trains them, so `looprl eval RUN --step N` can evaluate them again;
    the newest this many are kept per run. 0: none (export_hf_at_end alone decides the last step's)."""
    grace_seconds: float = Field(120.0, ge=0.0)
    """On SIGTERM, time for the current step and a final checkpoint."""
