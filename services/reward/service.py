"""The reward wiring: the verifier registry (with the sandbox for code rewards), reward-model
pools and compositions from the config, and the servicer."""

from __future__ import annotations

import logging

from services.reward.config import RewardConfig

log = logging.getLogger("looprl.reward")


async def serve(cfg: RewardConfig) -> None:
    from looprl.reward.v1 import reward_pb2_grpc
    from services.kit.rpc.server import Service, open_channel
    from services.reward.registry import default_registry
    from services.reward.servicer import RewardServicer, SandboxExecutor

    executor = SandboxExecutor(open_channel(cfg.sandbox_address)) if cfg.sandbox_address else None
    from services.kit.usercode.plugins import plugin_dirs_from

    registry = default_registry(
        executor, cfg.verifier_timeout_s, cfg.code_timeout_s, plugin_dirs_from(cfg.plugin_dirs)
    )
    service = Service("reward", cfg)
    service.add(reward_pb2_grpc.add_RewardServiceServicer_to_server, RewardServicer(registry))
    pools = []

    async def setup(_: Service) -> None:
        if cfg.reward_models:
            from services.kit.ray.cluster import connect_ray
            from services.reward.reward_model import RewardModelPool

            connect_ray(cfg.ray_address, cfg.namespace)
            for name, spec in cfg.reward_models.items():
                pool = await RewardModelPool(spec).start()
                pools.append(pool)
                registry.add_verifier(name, pool.verifier(), f"reward model {spec.model}", "model")
        for name, parts in cfg.compositions.items():
            registry.add_composite(name, parts)

    async def close_pools() -> None:
        for pool in pools:
            await pool.close()

    service.on_shutdown(close_pools)
    await service.run(setup)
