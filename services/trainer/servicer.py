"""TrainerService over gRPC: Status, Checkpoint and GetConfig of the runs the TrainerApp trains.

A request naming a run (`run_id`) is answered about that run; one naming none about the newest run
(Status also lists every run), or, for Checkpoint, the one run training.
"""

from __future__ import annotations

import json

import grpc

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.trainer.loop import RunTrainer
from services.trainer.runs import TrainerApp

TRAINING = ("training", "starting")


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, app: TrainerApp) -> None:
        self.app = app

    def _named(self, run_id: str) -> RunTrainer:
        run = self.app.runs.get(run_id)
        if run is None:
            held = ", ".join(self.app.runs) or "none"
            raise NotFound(f"run_id: the trainer holds no run {run_id!r} (it holds: {held})")
        return run

    async def Status(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.StatusResponse:
        if request.run_id:
            return _status(self._named(request.run_id))
        run = self.app.run
        if run is None:
            return trainer_pb2.StatusResponse(state="idle")
        reply = _status(run)
        reply.runs.extend(_status(r) for r in self.app.runs.values())
        return reply

    async def Checkpoint(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.CheckpointResponse:
        if request.run_id:
            run = self._named(request.run_id)
            if run.state not in TRAINING:
                raise FailedPrecondition(f"run {run.run_id!r} is not training (state {run.state!r})")
        else:
            training = [r for r in self.app.runs.values() if r.state in TRAINING]
            if not training:
                newest = self.app.run
                raise FailedPrecondition(f"no run is training (state {newest.state if newest else 'idle'!r})")
            if len(training) > 1:
                names = ", ".join(r.run_id for r in training)
                raise InvalidArgument(f"run_id: {len(training)} runs are training ({names}); name one")
            run = training[0]
        try:
            path, step, hf_path = await run.checkpoint(export_hf=request.export_hf)
        except RuntimeError as exc:
            raise FailedPrecondition(str(exc)) from exc
        return trainer_pb2.CheckpointResponse(path=path, step=step, hf_path=hf_path)

    async def GetConfig(self, request, context: grpc.aio.ServicerContext) -> trainer_pb2.GetConfigResponse:
        data: dict = {"service": self.app.cfg.model_dump(), "runs": list(self.app.runs)}
        run = self._named(request.run_id) if request.run_id else self.app.run
        if run is not None:
            data["run"] = {"run_id": run.run_id, "spec": run.spec.to_dict()}
        return trainer_pb2.GetConfigResponse(config_json=json.dumps(data, default=str))


def _status(run: RunTrainer) -> trainer_pb2.StatusResponse:
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
