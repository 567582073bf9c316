"""Configuration of the rollout-packer process (env vars) and of each run it packs (the run recipe).

Process settings come from LOOPRL_PACKER_<FIELD> / LOOPRL_<FIELD>. What a run decides (group size,
groups per step, staleness bound, estimator, token budget, trainer world size) comes from the run's
recipe: the gateway stores it in the KV bucket "runs"; `run_ids` + `recipe` serve runs without a
gateway. Imports nothing heavy, so a bad setting fails before torch loads.
"""

from __future__ import annotations

from pydantic import Field

from services.kit.config.service import ServiceConfig


class PackerConfig(ServiceConfig):
    ack_wait_s: float = Field(10.0, gt=0.0)
    """JetStream ack_wait of held rollouts; held ones are kept alive with in_progress(). After a crash,
    unacked rollouts are redelivered this long after their last heartbeat, so a killed packer's
    successor waits up to this long for the step the trainer is waiting on."""
    max_ack_pending: int = Field(65536, ge=1)
    """Most rollouts held unacked at once (queued + planned steps)."""
    fetch_batch: int = Field(256, ge=1)
    """Rollouts pulled per fetch from the bus."""
    retire_grace_s: float = Field(600.0, ge=0.0)
    """After a run ends, how long to wait for the trainer's last AckSteps before dropping it."""
    keep_acked_steps: int = Field(8, ge=1)
    """Acked step records always kept in KV to recognise redelivered trained rollouts (older ones stay while a
    redelivery is still possible)."""
    run_ids: str = ""
    """Comma-separated run ids to serve with `recipe` (no gateway needed)."""
    recipe: str = ""
    """Path to a run recipe (TOML) used for `run_ids`."""
    watch_runs: bool = True
    """Serve every active run recorded in the KV bucket 'runs'."""
    attention_weight: float = Field(0.0, ge=0.0)
    """Balance by tokens + w * tokens^2 (attention cost); 0 balances by tokens."""
    min_group_size: int = Field(2, ge=1)
    """A straggling group with fewer samples than this is dropped."""
    pad_token_id: int = Field(0, ge=0)
    """Token id of padding micro-batches."""
