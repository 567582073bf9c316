"""A replica binds and reports an address other hosts reach (ReplicaCore's host, RouterConfig.replica_host)."""

from __future__ import annotations

from services.kit.config.recipe import DeploymentSpec
from services.kit.process.hosts import host_identity, primary_address


async def test_a_replica_told_to_bind_its_node_address_serves_and_reports_it():
    import grpc

    from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
    from services.inference_router.replica import ReplicaCore

    core = ReplicaCore(DeploymentSpec(name="d"), replica="d-r0", host="node")
    try:
        address = await core.start()
        assert address.rsplit(":", 1)[0] == primary_address()
        async with grpc.aio.insecure_channel(address) as channel:
            status = await inference_pb2_grpc.InferenceEngineServiceStub(channel).Status(
                inference_pb2.StatusRequest(), timeout=10
            )
        assert status.host_id == host_identity() and status.weight_version == -1
        assert (await core.status()).host_id == host_identity()
    finally:
        await core.shutdown()
