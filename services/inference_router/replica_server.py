"""What an inference replica serves beside its engine, as every service does: the standard gRPC health
service and server reflection on its InferenceEngineService port, and a Prometheus /metrics port of
its own. A replica is a Ray actor, not a kit Service, so it sets these up here.

Health, as the contract says: "" and the engine service are SERVING once the server answers and
NOT_SERVING while it stops; a replica without weights or paused says so through Status, Generate's
UNAVAILABLE and the looprl_replica_ready gauge (as of its last status, which the router polls). Metrics: the kit's
per-RPC series (service "replica/<name>") and the replica's own gauges (looprl_replica_*), on a
port bound on the gRPC server's interface and picked by the kernel (bound 0, then reported in
StatusResponse.metrics_address, so no port is chosen before it is bound). The router lists every
replica's metrics address in ListDeployments and serves them as Prometheus HTTP service discovery
targets (its /targets, services/inference_router/targets.py).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from looprl.inference.v1 import inference_pb2
from services.inference_router.replica_status import ReplicaStatus
from services.kit.rpc.server import start_metrics_server
from services.kit.telemetry.metrics import gauge

ENGINE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceEngineService"].full_name

READY = gauge("looprl_replica_ready")
QUEUED = gauge("looprl_replica_queued_requests")
TOKENS = gauge("looprl_replica_tokens_in_flight")
CACHE = gauge("looprl_replica_cache_usage")


class ReplicaServer:
    """Health, reflection and /metrics of one replica (`deployment`, `replica` label its series)."""

    def __init__(self, server: grpc.aio.Server, deployment: str, replica: str) -> None:
        self.labels = (deployment, replica)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        self._metrics_server = None
        self.metrics_address = ""
        for metric in (READY, QUEUED, TOKENS, CACHE):
            metric.labels(*self.labels).set(0)

    async def start(self, host: str) -> None:
        """Serve health (SERVING) and /metrics on `host`, a port the kernel picks."""
        for service in ("", ENGINE_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._metrics_server = start_metrics_server(0, host)
        self.metrics_address = f"{host}:{self._metrics_server.server_port}"

    def update(self, status: ReplicaStatus) -> None:
        """The gauges from the replica's current status."""
        serving = status.ready and not status.paused
        READY.labels(*self.labels).set(1 if serving else 0)
        QUEUED.labels(*self.labels).set(status.queued_requests)
        TOKENS.labels(*self.labels).set(status.outstanding_tokens)
        CACHE.labels(*self.labels).set(status.cache_usage)

    async def stop(self) -> None:
        """NOT_SERVING while the gRPC server drains; the /metrics port closes."""
        await self.health.enter_graceful_shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
