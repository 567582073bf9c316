"""TrainerService over gRPC: Status, Checkpoint and GetConfig of the run the TrainerApp trains."""

from __future__ import annotations

import json

import grpc

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.errors import FailedPrecondition
from services.trainer.runs import TrainerApp


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, app: TrainerApp) -> None:
        self.app = app

    async def Status(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.StatusResponse:
        run = self.app.run
        if run is None:
            return trainer_pb2.StatusResponse(state="idle")
        return trainer_pb2.StatusResponse(
            run_id=run.run_id,
            step=run.step,
            weight_version=run.step,
            world_size=run.world_size,
            last_loss=run.last_loss,
            last_checkpoint=run.last_checkpoint,
            state=run.state,
            error=run.error,
        )

    async def Checkpoint(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.CheckpointResponse:
        run = self.app.run
        if run is None or run.state not in ("training", "starting"):
            raise FailedPrecondition(f"no run is training (state {run.state if run else 'idle'!r})")
        try:
            path, step, hf_path = await run.checkpoint(export_hf=request.export_hf)
        except RuntimeError as exc:
            raise FailedPrecondition(str(exc)) from exc
        return trainer_pb2.CheckpointResponse(path=path, step=step, hf_path=hf_path)

    async def GetConfig(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.GetConfigResponse:
        data = {"service": self.app.cfg.model_dump()}
        if self.app.run is not None:
            data["run"] = {"run_id": self.app.run.run_id, "spec": self.app.run.spec.to_dict()}
        return trainer_pb2.GetConfigResponse(config_json=json.dumps(data, default=str))
