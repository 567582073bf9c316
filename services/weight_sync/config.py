"""Settings of the weight-sync process (LOOPRL_WEIGHTSYNC_<FIELD>, then LOOPRL_<FIELD>).
Imports nothing heavy, so a bad setting fails before torch loads."""

from __future__ import annotations

from pydantic import Field

from services.kit.config.service import ServiceConfig


class WeightSyncConfig(ServiceConfig):
    bucket_bytes: int = Field(32 << 20, ge=1 << 10, le=1 << 31)
    """Target bucket size. Large buckets amortize per-message cost; they must stay below the receivers' max
    gRPC message size."""
    shm_segments: int = Field(3, ge=1, le=64)
    """Shared-memory segments in flight per target rank group."""
    shared_copy_min_receivers: int = Field(2, ge=0)
    """Co-located receivers of one layout from which they share one copy of the weights in shared memory (each
    serves from it read-only) instead of copying it each; 0 turns shared copies off."""
    shared_copies: int = Field(3, ge=1, le=64)
    """Shared copies kept per receiver group (a copy is reused once no receiver serves, can roll back to or
    stages its version): 3 covers serving + rollback + the next version; each costs the rank's weights in
    /dev/shm."""
    prefetch_buckets: int = Field(2, ge=0, le=64)
    """Buckets assembled ahead of the network (gRPC)."""
    retry_attempts: int = Field(3, ge=1)
    """Delivery attempts per version and deployment."""
    retry_backoff_s: float = Field(0.5, ge=0.0)
    """First retry delay; doubles per attempt."""
    stage_timeout_s: float = Field(600.0, gt=0.0)
    """Deadline of one StageWeights call."""
    pipeline: bool = True
    """Start sending a version's buckets while the trainer is still pushing it, using the plan of the previous
    version's layout."""
    canary_tokens: int = Field(8, ge=1)
    """Greedy tokens per golden prompt when a canary policy names none."""
    canary_max_drift: float = Field(0.5, gt=0.0)
    """Largest accepted mean |log-prob change| (nats) of a canary's greedy tokens when its policy names none."""
    run_id: str = "default"
    """Run id for events when a push names none."""
    use_bus: bool = True
    """Publish weights events and keep state in NATS KV."""
