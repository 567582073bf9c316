"""Who may call what: the one table of service-to-service authorization.

Keys are gRPC services (full protobuf names), then methods; values are the identities (certificate
common names, services/kit/rpc/tls.py) allowed to call them. Anything not in the table is denied, so a
new RPC is refused until someone decides who may call it (tests/security checks every RPC in the
protos has an entry). Health checks and reflection are open to every caller holding a certificate
from the stack's CA (the TLS handshake already proved that): probes and tooling need them, and they
reveal only serving status and the public contracts. The gateway's public API is not in the table:
users reach it with bearer tokens (gateway/auth.py), not certificates.
"""

from __future__ import annotations

from services.kit.rpc.tls import OPERATOR  # the local CLI and the stack's own tooling

POLICY: dict[str, dict[str, frozenset[str]]] = {
    "looprl.weightsync.v1.WeightSyncService": {
        "PushShards": frozenset({"trainer"}),
        "RegisterTarget": frozenset({"inference-router"}),
        "RequestSync": frozenset({"inference-router"}),
        "UnregisterTarget": frozenset({"inference-router"}),
        "GetVersion": frozenset({"trainer", "inference-router", "gateway", OPERATOR}),
    },
    # Engine replicas (and external deployments): weights come only from weight-sync.
    "looprl.inference.v1.InferenceEngineService": {
        "Generate": frozenset({"inference-router"}),
        "Status": frozenset({"inference-router", "weight-sync", OPERATOR}),
        "Pause": frozenset({"inference-router"}),
        "Resume": frozenset({"inference-router"}),
        "StageWeights": frozenset({"weight-sync"}),
        "CommitWeights": frozenset({"weight-sync"}),
        "AbortWeights": frozenset({"weight-sync"}),
        "RollbackWeights": frozenset({"weight-sync"}),
        "ProbeSharedMemory": frozenset({"weight-sync"}),
        # A decode worker reads a prompt's KV from a prefill worker of its deployment; replicas
        # present the router's identity.
        "FetchKV": frozenset({"inference-router"}),
    },
    "looprl.inference.v1.InferenceRouterService": {
        "Generate": frozenset({"environment-sandbox", "gateway"}),
        "GenerateStream": frozenset({"environment-sandbox", "gateway"}),
        "ListDeployments": frozenset({"environment-sandbox", "gateway", OPERATOR}),
        "RegisterDeployment": frozenset({OPERATOR}),
        "GetClusterResources": frozenset({"gateway", OPERATOR}),
    },
    "looprl.environment.v1.EnvironmentSandboxService": {
        # The gateway runs a run's evaluation episodes (never published, never trained).
        "RunEpisode": frozenset({"gateway", OPERATOR}),
        "Reset": frozenset({OPERATOR}),
        "Step": frozenset({OPERATOR}),
        "Exec": frozenset({"reward"}),
        "ListEnvironments": frozenset({"gateway", OPERATOR}),
        "LoadEnvironment": frozenset({"gateway", OPERATOR}),
    },
    "looprl.reward.v1.RewardService": {
        "Score": frozenset({"environment-sandbox"}),
        "ScoreBatch": frozenset({"environment-sandbox"}),
        "ListRewards": frozenset({"environment-sandbox", "gateway", OPERATOR}),
        "LoadReward": frozenset({"gateway", OPERATOR}),
    },
    "looprl.packer.v1.RolloutPackerService": {
        "NextBatch": frozenset({"trainer"}),
        "AckStep": frozenset({"trainer"}),
        "Stats": frozenset({"gateway", OPERATOR}),
    },
    "looprl.trainer.v1.TrainerService": {
        "Status": frozenset({"gateway", OPERATOR}),
        "Checkpoint": frozenset({OPERATOR}),
        "GetConfig": frozenset({"gateway", OPERATOR}),
    },
}

# Open to any caller the TLS handshake authenticated.
ANY_AUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def allowed_callers(method: str) -> frozenset[str]:
    """Identities that may call method ("/package.Service/Method"); empty when none may."""
    service, _, name = method.lstrip("/").partition("/")
    return POLICY.get(service, {}).get(name, frozenset())


def denial(method: str, identity: str | None) -> tuple[str, str] | None:
    """None if identity may call method, else (status code name, message) to refuse it with."""
    if identity is None:
        return "UNAUTHENTICATED", f"{method}: the caller presented no verified client certificate"
    if method.startswith(ANY_AUTHENTICATED_PREFIXES):
        return None
    callers = allowed_callers(method)
    if identity in callers:
        return None
    who = ", ".join(sorted(callers)) or "no caller"
    return "PERMISSION_DENIED", f"{method}: {identity!r} may not call it (allowed: {who})"
