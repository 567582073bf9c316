"""The one table of looprl's services: name, package, config, env prefix, entry point and peers.

`run_service` (services/kit/entrypoint.py) starts a service from its entry here, `looprl up`
(gateway/stack.py) starts every entry in this order, and the deploy tests check docker-compose.yml
and the Kubernetes manifests against it. A new service is one more entry.

Every service package is laid out the same way:
  __main__.py  `sys.exit(run_service("<name>"))`, nothing else
  config.py    its ServiceConfig subclass (parsed before anything heavy is imported)
  service.py   the wiring: `async def serve(cfg)` builds the Service, its servicer(s) and tasks
  servicer.py  the gRPC servicer class(es)
  the rest     domain modules

Strings, not objects: this module imports nothing (no service, no grpc), so the CLI, the tests
and an entry point can read it in microseconds; `config_class()` and `serve_function()` import
on demand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    """Process, certificate, NATS user, compose service and k8s Deployment name."""
    package: str
    """What `python -m` runs."""
    config: str
    """"module:Class" of its ServiceConfig subclass."""
    env_prefix: str
    """Its settings are LOOPRL_<env_prefix>_<FIELD> (or the shared LOOPRL_<FIELD>)."""
    serve: str
    """"module:function" of `async def serve(cfg)`, imported only once the config parsed."""
    grpc_service: str
    """Full protobuf name of the gRPC API it serves (the key of services/kit/rpc/authz.py POLICY)."""
    address_field: str = ""
    """The config field by which its callers find it (LOOPRL_<FIELD> in `looprl up`); "" when no
    service calls it."""
    peers: tuple[str, ...] = ()
    """Services it calls over gRPC, each through that service's address_field in its own config."""
    ray_driver: bool = False
    """It joins the Ray cluster as a driver (its replicas, ranks or workers are Ray actors): only these
    services are given the cluster's address and token (RAY_AUTH_TOKEN), in `looprl up`, compose and
    Kubernetes alike."""

    def config_class(self) -> type:
        return _resolve(self.config)

    def serve_function(self) -> Any:
        return _resolve(self.serve)

    def env_var(self, field: str) -> str:
        """The service-specific variable of a config field."""
        return f"LOOPRL_{self.env_prefix}_{field.upper()}"


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


# In start order: callees before their callers, the gateway (the front door) last.
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        name="weight-sync",
        package="services.weight_sync",
        config="services.weight_sync.config:WeightSyncConfig",
        env_prefix="WEIGHTSYNC",
        serve="services.weight_sync.service:serve",
        grpc_service="looprl.weightsync.v1.WeightSyncService",
        address_field="weight_sync_address",
    ),
    ServiceSpec(
        name="inference-router",
        package="services.inference_router",
        config="services.inference_router.config:RouterConfig",
        env_prefix="INFERENCE_ROUTER",
        serve="services.inference_router.service:serve",
        grpc_service="looprl.inference.v1.InferenceRouterService",
        address_field="router_address",
        peers=("weight-sync",),
        ray_driver=True,
    ),
    ServiceSpec(
        name="reward",
        package="services.reward",
        config="services.reward.config:RewardConfig",
        env_prefix="REWARD",
        serve="services.reward.service:serve",
        grpc_service="looprl.reward.v1.RewardService",
        address_field="reward_address",
        peers=("environment-sandbox",),  # code rewards run their tests in the sandbox
        ray_driver=True,
    ),
    ServiceSpec(
        name="environment-sandbox",
        package="services.environment_sandbox",
        config="services.environment_sandbox.config:EnvServiceConfig",
        env_prefix="ENV",
        serve="services.environment_sandbox.service:serve",
        grpc_service="looprl.environment.v1.EnvironmentSandboxService",
        address_field="sandbox_address",
        peers=("inference-router", "reward"),
        ray_driver=True,
    ),
    ServiceSpec(
        name="rollout-packer",
        package="services.rollout_packer",
        config="services.rollout_packer.config:PackerConfig",
        env_prefix="PACKER",
        serve="services.rollout_packer.service:serve",
        grpc_service="looprl.packer.v1.RolloutPackerService",
        address_field="packer_address",
    ),
    ServiceSpec(
        name="trainer",
        package="services.trainer",
        config="services.trainer.config:TrainerConfig",
        env_prefix="TRAINER",
        serve="services.trainer.service:serve",
        grpc_service="looprl.trainer.v1.TrainerService",
        peers=("rollout-packer", "weight-sync"),
        ray_driver=True,
    ),
    ServiceSpec(
        name="gateway",
        package="gateway",
        config="gateway.config:GatewayConfig",
        env_prefix="GATEWAY",
        serve="gateway.service:serve",
        grpc_service="looprl.gateway.v1.GatewayService",
        peers=("inference-router", "environment-sandbox", "reward", "rollout-packer"),
    ),
)

NAMES: tuple[str, ...] = tuple(s.name for s in SERVICES)


def service(name: str) -> ServiceSpec:
    """The entry of `name`; KeyError naming the known services otherwise."""
    for spec in SERVICES:
        if spec.name == name:
            return spec
    raise KeyError(f"no service {name!r}; the services are {', '.join(NAMES)}")
