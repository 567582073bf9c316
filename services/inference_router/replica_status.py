"""What a replica reports about itself, as one typed value: the router routes and resyncs by it,
registers its ranks with weight-sync from it, and InferenceEngineService.Status answers with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from looprl.inference.v1 import inference_pb2


@dataclass
class ReplicaStatus:
    """One replica's state; -1 is "none" for every version field."""

    replica: str = ""
    deployment: str = ""
    address: str = ""
    """Where its InferenceEngineService listens."""
    metrics_address: str = ""
    """Where its Prometheus /metrics listens ("" for a replica that serves none)."""
    rank_addresses: list[str] = field(default_factory=list)
    """Where weight-sync delivers each TP rank's weights (one server serves every rank today)."""
    host_id: str = ""
    """services/kit/process/hosts.py's identity of the host and shared-memory namespace it runs in."""
    backend: str = ""
    tensor_parallel: int = 1
    layout: str = ""
    """Parameter naming of its weights ("hf" or "fused"); "" when it did not say."""
    dtype: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    """0 until weights (and with them the model config) arrived."""
    ready: bool = False
    paused: bool = False
    weight_version: int = -1
    staged_version: int = -1
    rollback_version: int = -1
    rolled_back_version: int = -1
    """The newest version a canary rollback undid here."""
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_requests: int = 0
    cache_usage: float = 0.0
    holds_for_version: bool = False
    """Generate holds a request sent ahead of its version (GenerateRequest.version_wait_ms)."""
    engine: dict[str, int | float | str] = field(default_factory=dict)
    """Backend-specific figures (e.g. vLLM's swap seconds), for logs and debugging."""
    adapter_versions: dict[str, int] = field(default_factory=dict)
    """LoRA: each run's adapter version this replica serves."""

    def to_proto(self) -> inference_pb2.StatusResponse:
        return inference_pb2.StatusResponse(
            weight_version=self.weight_version,
            queued_requests=self.queued_requests,
            tokens_in_flight=self.outstanding_tokens,
            cache_usage=self.cache_usage,
            paused=self.paused,
            staged_version=self.staged_version,
            rollback_version=self.rollback_version,
            host_id=self.host_id,
            holds_for_version=self.holds_for_version,
            adapter_versions=self.adapter_versions,
            metrics_address=self.metrics_address,
        )

    @classmethod
    def from_proto(cls, reply: inference_pb2.StatusResponse, name: str, address: str) -> ReplicaStatus:
        """An external server's Status (it serves once it holds weights and is not paused)."""
        return cls(
            replica=name,
            address=address,
            rank_addresses=[address],
            host_id=reply.host_id,
            ready=not reply.paused and reply.weight_version >= 0,
            paused=reply.paused,
            weight_version=reply.weight_version,
            staged_version=reply.staged_version,
            rollback_version=reply.rollback_version,
            outstanding_requests=reply.queued_requests,
            outstanding_tokens=reply.tokens_in_flight,
            queued_requests=reply.queued_requests,
            cache_usage=reply.cache_usage,
            holds_for_version=reply.holds_for_version,
            adapter_versions=dict(reply.adapter_versions),
            metrics_address=reply.metrics_address,
        )
