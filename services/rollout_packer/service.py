"""The rollout-packer wiring: the PackerApp (one RunPacker per active run), the servicer that
hands out its micro-batches, and the Service that serves them."""

from __future__ import annotations

from services.rollout_packer.config import PackerConfig
from services.rollout_packer.runs import PackerApp


async def serve(cfg: PackerConfig) -> None:
    from looprl.packer.v1 import packer_pb2_grpc
    from services.kit.rpc.server import Service
    from services.rollout_packer.servicer import RolloutPackerServicer

    app = PackerApp(cfg)
    service = Service("rollout-packer", cfg)
    service.add(packer_pb2_grpc.add_RolloutPackerServiceServicer_to_server, RolloutPackerServicer(app.lookup))

    async def setup(_: Service) -> None:
        await app.start()

    service.on_shutdown(app.stop)
    await service.run(setup)
