"""Configuration of the rollout-packer process (env vars) and of each run it packs (the run recipe).

Process settings come from LOOPRL_PACKER_<FIELD> / LOOPRL_<FIELD>. What a run decides (group size,
groups per step, staleness bound, estimator, token budget, trainer world size) comes from the run's
recipe: the gateway stores it in the KV bucket "runs"; `run_ids` + `recipe` serve runs without a
gateway. Imports nothing heavy, so a bad setting fails before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ServiceConfig


@dataclass
class PackerConfig(ServiceConfig):
    ack_wait_s: float = field(
        default=30.0,
        metadata={
            "help": "JetStream ack_wait of held rollouts; held ones are kept alive with in_progress(). "
            "After a crash, unacked rollouts are redelivered this long after their last heartbeat."
        },
    )
    max_ack_pending: int = field(
        default=65536, metadata={"help": "Most rollouts held unacked at once (queued + planned steps)."}
    )
    fetch_batch: int = field(default=256, metadata={"help": "Rollouts pulled per fetch from the bus."})
    retire_grace_s: float = field(
        default=600.0,
        metadata={
            "help": "After a run ends, how long to wait for the trainer's last AckSteps before dropping it."
        },
    )
    keep_acked_steps: int = field(
        default=8,
        metadata={
            "help": "Acked step records always kept in KV to recognise redelivered trained rollouts (older ones "
            "stay while a redelivery is still possible)."
        },
    )
    state_bucket: str = field(
        default="packer", metadata={"help": "KV bucket holding step plans and acknowledgements."}
    )
    run_ids: str = field(
        default="", metadata={"help": "Comma-separated run ids to serve with `recipe` (no gateway needed)."}
    )
    recipe: str = field(default="", metadata={"help": "Path to a run recipe (TOML) used for `run_ids`."})
    watch_runs: bool = field(
        default=True, metadata={"help": "Serve every active run recorded in the KV bucket 'runs'."}
    )
    attention_weight: float = field(
        default=0.0,
        metadata={"help": "Balance by tokens + w * tokens^2 (attention cost); 0 balances by tokens."},
    )
    min_group_size: int = field(
        default=2, metadata={"help": "A straggling group with fewer samples than this is dropped."}
    )
    pad_token_id: int = field(default=0, metadata={"help": "Token id of padding micro-batches."})
