"""What the router adds: the same short generate call through the router vs made directly to the
replica's own InferenceEngineService gRPC server, and the routing decision's own time.

Setup: a private Ray head, the router as a real process (`python -m services.inference_router`)
with one tp=1 replica of a tiny Qwen2; the client in this process. Calls alternate between the two
paths so machine noise hits both alike.

Figures: decision_p50_us (policy decision, target < 100 us), added_p50_ms and added_p99_ms
(router p50/p99 minus direct p50/p99, target added p50 < 1.5 ms).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import emit, parse_args, percentile

BENCH = "router_overhead"


def decision_times(n: int) -> list[float]:
    """The real policy over a realistic fleet: 2 deployments x 4 replicas, sessions, varied lengths."""
    from services.inference_router.policies import (
        DeploymentState,
        LengthProfile,
        ReplicaState,
        RouteRequest,
        RoutingPolicy,
        SessionAffinity,
    )
    from services.inference_router.router import Router

    router = Router(RoutingPolicy(affinity=SessionAffinity()))
    for name, profile in (
        ("short", LengthProfile(max_output_tokens=256)),
        ("long", LengthProfile(min_output_tokens=257)),
    ):
        dep = DeploymentState(name=name, profile=profile, max_model_len=8192)
        dep.replicas = [
            ReplicaState(
                name=f"{name}-{i}", deployment=name, healthy=True, weight_version=3, outstanding_tokens=i * 37
            )
            for i in range(4)
        ]
        router.deployments[name] = dep
    requests = [
        RouteRequest(
            prompt_tokens=20 + i % 300,
            output_tokens=(i * 97) % 1024,
            total_tokens=20 + i % 300 + 1024,
            session_id=f"s{i % 500}" if i % 3 else "",
            min_weight_version=i % 3,
        )
        for i in range(n)
    ]
    for r in requests[:200]:
        router.decide(r)
    router.decision_seconds.clear()
    for r in requests:
        router.decide(r)
    return list(router.decision_seconds)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 150 if args.quick else 600

    import grpc

    from bench.harness.local_fleet import (
        RouterProcess,
        load_weights,
        replica_actor,
        tiny_checkpoint,
    )
    from looprl.common.v1 import common_pb2
    from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
    from services.kit.local.infra import RayHead

    decisions = decision_times(20_000 if not args.quick else 5_000)

    state = Path(tempfile.mkdtemp(prefix="bench-router-"))
    port = next(
        p for p in range(26600, 26700, 7) if all(_free(q) for q in range(p, p + 7))
    )  # the head's 7 ports
    head = RayHead(state_dir=state / "ray", port=port, num_cpus=4).start()
    os.environ.update(head.env())
    import ray  # after the head's auth settings are in the environment: Ray reads them on import

    router = None
    try:
        ray.init(address=head.address, logging_level="ERROR")
        deployments = [
            {"name": "d", "replicas": 1, "tensor_parallel": 1, "max_model_len": 64, "max_batch_size": 8}
        ]
        router = RouterProcess(deployments, state / "router.log", status_interval_s=0.5).wait_serving(150)
        actor = replica_actor("d", 0, router.namespace)
        config, weights = tiny_checkpoint(0)
        ray.get(load_weights(actor, config, weights, 1), timeout=120)
        direct_address = ray.get(actor.address.remote(), timeout=30)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7, 8], sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)
        )
        with grpc.insecure_channel(router.address) as rc, grpc.insecure_channel(direct_address) as dc:
            via_router = inference_pb2_grpc.InferenceRouterServiceStub(rc)
            direct = inference_pb2_grpc.InferenceEngineServiceStub(dc)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the router has polled the replica as ready
                try:
                    via_router.Generate(request, timeout=10)
                    break
                except grpc.RpcError:
                    time.sleep(0.3)
            for _ in range(30):
                via_router.Generate(request, timeout=10)
                direct.Generate(request, timeout=10)
            routed_s, direct_s = [], []
            for _ in range(n):
                t = time.perf_counter()
                direct.Generate(request, timeout=10)
                direct_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                via_router.Generate(request, timeout=10)
                routed_s.append(time.perf_counter() - t)
    finally:
        if router is not None:
            router.stop()
        if ray.is_initialized():
            ray.shutdown()
        head.stop()

    d50, d99 = percentile(direct_s, 50) * 1e3, percentile(direct_s, 99) * 1e3
    r50, r99 = percentile(routed_s, 50) * 1e3, percentile(routed_s, 99) * 1e3
    dec50, dec99 = percentile(decisions, 50) * 1e6, percentile(decisions, 99) * 1e6
    print(f"\n{n} alternating calls (max_tokens=1, tiny Qwen2, tp=1)")
    print(f"{'path':<22}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct to replica':<22}{d50:>10.3f}{d99:>10.3f}")
    print(f"{'through router':<22}{r50:>10.3f}{r99:>10.3f}")
    print(f"{'added':<22}{r50 - d50:>10.3f}{r99 - d99:>10.3f}")
    print(f"routing decision: p50 {dec50:.1f} us, p99 {dec99:.1f} us over {len(decisions)} decisions")
    emit(BENCH, "decision_p50_us", dec50, None, None, "us", "< 100")
    emit(BENCH, "added_p50_ms", r50 - d50, d50, r50 / d50, "ms", "< 1.5", checks="value")
    emit(BENCH, "added_p99_ms", r99 - d99, d99, r99 / d99, "ms", "report")


def _free(port: int) -> bool:
    from services.kit.local.infra import port_is_free

    return port_is_free(port)


if __name__ == "__main__":
    main()
