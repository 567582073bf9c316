"""Settings of the weight-sync process (LOOPRL_WEIGHTSYNC_<FIELD>, then LOOPRL_<FIELD>).
Imports nothing heavy, so a bad setting fails before torch loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.kit.config import ServiceConfig


def _setting(default: Any, help: str) -> Any:
    """A setting with its help text (shown by `describe` and the service's --help)."""
    return field(default=default, metadata={"help": help})


@dataclass
class WeightSyncConfig(ServiceConfig):
    bucket_bytes: int = _setting(
        32 << 20,
        "Target bucket size. Large buckets amortize per-message cost; they must stay below the "
        "receivers' max gRPC message size.",
    )
    shm_segments: int = _setting(3, "Shared-memory segments in flight per target rank group.")
    shared_copy_min_receivers: int = _setting(
        2,
        "Co-located receivers of one layout from which they share one copy of the weights in shared "
        "memory (each serves from it read-only) instead of copying it each; 0 turns shared copies "
        "off.",
    )
    shared_copies: int = _setting(
        3,
        "Shared copies kept per receiver group (a copy is reused once no receiver serves, can roll "
        "back to or stages its version): 3 covers serving + rollback + the next version; each costs "
        "the rank's weights in /dev/shm.",
    )
    prefetch_buckets: int = _setting(2, "Buckets assembled ahead of the network (gRPC).")
    retry_attempts: int = _setting(3, "Delivery attempts per version and deployment.")
    retry_backoff_s: float = _setting(0.5, "First retry delay; doubles per attempt.")
    stage_timeout_s: float = _setting(600.0, "Deadline of one StageWeights call.")
    pipeline: bool = _setting(
        True,
        "Start sending a version's buckets while the trainer is still pushing it, using the plan of "
        "the previous version's layout.",
    )
    canary_tokens: int = _setting(8, "Greedy tokens per golden prompt when a canary policy names none.")
    canary_max_drift: float = _setting(
        0.5,
        "Largest accepted mean |log-prob change| (nats) of a canary's greedy tokens when its policy "
        "names none.",
    )
    run_id: str = _setting("default", "Run id for events when a push names none.")
    use_bus: bool = _setting(True, "Publish weights events and keep state in NATS KV.")
