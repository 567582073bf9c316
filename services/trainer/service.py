"""The trainer wiring: the TrainerApp (the run it trains), its servicer, and the Service that
serves them; SIGTERM stops the app (final checkpoint) before the process exits."""

from __future__ import annotations

from looprl.trainer.v1 import trainer_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.runs import TrainerApp
from services.trainer.servicer import TrainerServicer


async def serve(cfg: TrainerConfig) -> None:
    from services.kit.rpc.server import Service

    app = TrainerApp(cfg)
    service = Service("trainer", cfg)
    service.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(app))

    async def setup(_: Service) -> None:
        await app.start()

    service.on_shutdown(app.stop)
    await service.run(setup)
