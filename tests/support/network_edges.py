"""Who connects to whom in a deployed stack: the one table of network edges that the deploy tests
hold both docker-compose.yml's networks and the Kubernetes NetworkPolicies to.

Derived wherever the code has a source of truth, so the table cannot drift from it:
- gRPC: the callers services/kit/rpc/authz.py allows on each service's API. The operator CLI is left
  out: it comes from the host (a published port, a port-forward), not from a peer. The Ray actors
  of the identities in ACTOR_CALLERS call too, and the inference replicas (on the Ray nodes) are
  called by the callers of InferenceEngineService.
- Ray: every Ray node reaches every other (GCS, raylets, object transfers, actors calling back
  their drivers; an actor asking for no CPU may land on any node). The Ray nodes are RAY and the
  Ray drivers (registry `ray_driver`), each of which joins the cluster as a zero-resource node
  (deploy/docker/entrypoint.sh). The network they share also holds the other services but the
  gateway (the mesh: weight-sync calls the replicas' engine ports there), which hold neither the
  cluster's address nor its token: Ray's ports refuse them.
- NATS: every service. Traces: every service exports to the collector, and so do the Ray actors
  (replicas and trainer ranks trace like the service that started them:
  kit.telemetry.exporter_settings).
- Metrics: Prometheus scrapes every service, and the inference replicas on the Ray nodes (found
  through the router's /targets).
- The observability stack's own edges, which only compose runs: the collector exports to Tempo,
  Tempo writes span metrics to Prometheus, Prometheus scrapes the collector and Tempo, Grafana
  queries Prometheus and Tempo. test_deploy_compose.py checks them against the observability configs.

Names are compose services and Kubernetes app names; RAY stands for the nodes that run actors (the
compose ray-head, the KubeRay pods labelled app.kubernetes.io/component=ray).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.kit.config import registry
from services.kit.rpc.authz import POLICY
from services.kit.rpc.tls import OPERATOR

RAY = "ray"
NATS, COLLECTOR, TEMPO, PROMETHEUS, GRAFANA = "nats", "otel-collector", "tempo", "prometheus", "grafana"
SERVICES: tuple[str, ...] = registry.NAMES
# Identities whose Ray actors call other services with the identity their service hands them
# (tls.export -> tls.adopt): trainer ranks push weights to weight-sync and pull batches from the packer.
ACTOR_CALLERS = frozenset({"trainer"})
ENGINE_API = "looprl.inference.v1.InferenceEngineService"  # served by replicas on the Ray nodes
# Only the Ray drivers join the cluster and hold its token; the mesh network they share is every
# service's but the gateway's, which faces users.
RAY_DRIVERS = frozenset(s.name for s in registry.SERVICES if s.ray_driver)
RAY_NODES = frozenset({RAY, *(name for name in SERVICES if name != "gateway")})


@dataclass(frozen=True)
class Edge:
    caller: str
    callee: str
    what: str
    """grpc, ray, nats, otlp, metrics, remote-write or query."""


def grpc_callers(callee: str) -> frozenset[str]:
    """Who connects to callee's gRPC port (callee RAY: the replicas' engine ports). Empty for the
    gateway: its API is not in the authorization table, users reach it from the host with tokens."""
    api = ENGINE_API if callee == RAY else registry.service(callee).grpc_service
    callers = set().union(*POLICY.get(api, {}).values()) - {OPERATOR}
    if callers & ACTOR_CALLERS:
        callers.add(RAY)
    return frozenset(callers)


def declared_edges() -> frozenset[Edge]:
    edges = {Edge(caller, callee, "grpc") for callee in (*SERVICES, RAY) for caller in grpc_callers(callee)}
    edges |= {Edge(a, b, "ray") for a in RAY_NODES for b in RAY_NODES if a != b}
    edges |= {Edge(name, NATS, "nats") for name in SERVICES}
    edges |= {Edge(name, COLLECTOR, "otlp") for name in (*SERVICES, RAY)}
    edges |= {Edge(PROMETHEUS, name, "metrics") for name in (*SERVICES, RAY, COLLECTOR, TEMPO)}
    edges |= {
        Edge(COLLECTOR, TEMPO, "otlp"),
        Edge(TEMPO, PROMETHEUS, "remote-write"),
        Edge(GRAFANA, PROMETHEUS, "query"),
        Edge(GRAFANA, TEMPO, "query"),
    }
    return frozenset(edges)


EDGES = declared_edges()
