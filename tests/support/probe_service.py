"""A minimal service built on the kit, run as its own process by the kit's tests.

It implements TrainerService with controllable behaviour: Status sleeps for the number of
seconds in LOOPRL_PROBE_DELAY (to hold a call in flight across SIGTERM), Checkpoint raises an
unexpected error (to see INTERNAL with a trace id), GetConfig echoes the trace id it saw. LOOPRL_PROBE_IDENTITY names its TLS identity.
"""

import asyncio
import os

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.config.service import ServiceConfig, load_config
from services.kit.rpc.server import Service
from services.kit.telemetry import tracing as telemetry


class Probe(trainer_pb2_grpc.TrainerServiceServicer):
    async def Status(self, request, context):
        await asyncio.sleep(float(os.environ.get("LOOPRL_PROBE_DELAY", "0")))
        return trainer_pb2.StatusResponse(state="done", step=7)

    async def Checkpoint(self, request, context):
        raise RuntimeError("disk on fire")

    async def GetConfig(self, request, context):
        trace_id, _ = telemetry.current_ids()
        return trainer_pb2.GetConfigResponse(config_json=trace_id)


async def main() -> None:
    # LOOPRL_PROBE_IDENTITY lets the security tests run it under a real service's certificate.
    name = os.environ.get("LOOPRL_PROBE_IDENTITY", "probe")
    service = Service(name, load_config(ServiceConfig, "PROBE"))
    service.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, Probe())
    await service.run()


if __name__ == "__main__":
    asyncio.run(main())
