"""Settings of the weight-sync process (LOOPRL_WEIGHTSYNC_<FIELD>, then LOOPRL_<FIELD>).
Imports nothing heavy, so a bad setting fails before torch loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kit.config import ServiceConfig


@dataclass
class WeightSyncConfig(ServiceConfig):
    bucket_bytes: int = field(
        default=32 << 20,
        metadata={"help": "Target bucket size. Large buckets amortize per-message cost; they must stay "
                          "below the receivers' max gRPC message size."},
    )  # fmt: skip
    shm_segments: int = field(
        default=3, metadata={"help": "Shared-memory segments in flight per target rank group."}
    )
    shared_copy_min_receivers: int = field(
        default=2,
        metadata={"help": "Co-located receivers of one layout from which they share one copy of the weights "
                          "in shared memory (each serves from it read-only) instead of copying it each; "
                          "0 turns shared copies off."},
    )  # fmt: skip
    shared_copies: int = field(
        default=3,
        metadata={"help": "Shared copies kept per receiver group (a copy is reused once no receiver serves, "
                          "can roll back to or stages its version): 3 covers serving + rollback + the next "
                          "version; each costs the rank's weights in /dev/shm."},
    )  # fmt: skip
    prefetch_buckets: int = field(
        default=2, metadata={"help": "Buckets assembled ahead of the network (gRPC)."}
    )
    retry_attempts: int = field(default=3, metadata={"help": "Delivery attempts per version and deployment."})
    retry_backoff_s: float = field(default=0.5, metadata={"help": "First retry delay; doubles per attempt."})
    stage_timeout_s: float = field(default=600.0, metadata={"help": "Deadline of one StageWeights call."})
    pipeline: bool = field(
        default=True,
        metadata={"help": "Start sending a version's buckets while the trainer is still pushing it, using the "
                          "plan of the previous version's layout."},
    )  # fmt: skip
    canary_tokens: int = field(
        default=8, metadata={"help": "Greedy tokens per golden prompt when a canary policy names none."}
    )
    canary_max_drift: float = field(
        default=0.5,
        metadata={"help": "Largest accepted mean |log-prob change| (nats) of a canary's greedy tokens when "
                          "its policy names none."},
    )  # fmt: skip
    run_id: str = field(default="default", metadata={"help": "Run id for events when a push names none."})
    use_bus: bool = field(
        default=True, metadata={"help": "Publish weights events and keep state in NATS KV."}
    )
