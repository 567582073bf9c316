"""tools/gpu_torch_check.py's transport section: the weight transport from this process to a receiver
process it starts (`python -m tools.gpu_weight_transport RECEIVER_CONFIG DEVICE`), cuda_ipc on a GPU
and gRPC on the CPU: stage, verify, commit, the receiver's weights compared; GB/s against a copy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.gpu_torch_steps import model_configs, synchronize

ROOT = Path(__file__).resolve().parents[1]


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """XXH3-64 of each tensor's bytes, as weight-sync checks slices."""
    import torch

    from services.weights.checksum import hash64

    out = {}
    for name, tensor in sorted(state.items()):
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        out[name] = format(hash64(data), "016x")
    return out


def receiver_main(config_json: str, device: str) -> None:
    """The receiving process: a replica rank that holds weights (services/weights), serving
    StageWeights/CommitWeights; prints its address, then each committed version's digests on request."""
    from services.modeling.config import ModelConfig
    from services.modeling.layouts import Layout, rank_params
    from services.weights import WeightOnlyEngine, WeightStager, serve_engine

    config = ModelConfig.from_dict(json.loads(config_json))

    async def main() -> None:
        engine = WeightOnlyEngine(
            WeightStager(rank_params(config, Layout(1, "hf"), 0), rank=0, device=device)
        )
        server, address = await serve_engine(engine)
        print(f"ADDRESS {address}", flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            print(
                "DIGESTS " + json.dumps({"version": engine.version, "digests": _digests(engine.weights)}),
                flush=True,
            )
        await server.stop(None)

    asyncio.run(main())


def _transport(device: str) -> Any:
    """The transport under test, talking over a plain channel when the tracing interceptors cannot be
    imported (a bare CUDA image has no OpenTelemetry)."""
    from services.kit.rpc import tls
    from services.weight_sync.transport.gpu import CudaIpcTransport
    from services.weight_sync.transport.grpc_stream import GrpcTransport

    base = CudaIpcTransport if device == "cuda" else GrpcTransport

    class Transport(base):  # type: ignore[misc, valid-type]
        def channel(self, address: str) -> Any:
            try:
                return super().channel(address)
            except ImportError:
                ch = self._channels.get(address)
                if ch is None:
                    ch = self._channels[address] = tls.aio_channel(
                        address, tls.message_limits(self.max_message_bytes)
                    )
                return ch

    return Transport(device) if device == "cuda" else Transport()


def section_transport(device: str, cpu_mode: bool) -> dict[str, Any]:
    from services.kit.rpc import tls
    from services.modeling.layouts import Layout
    from services.modeling.qwen2 import Qwen2ForCausalLM
    from services.trainer.shards import push_requests
    from services.weight_sync.plan import build_deployment_plan
    from services.weight_sync.planned_bucket import PlannedBucket
    from services.weight_sync.transport import Delivery, Endpoint
    from services.weight_sync.versions import VersionStore

    tls.adopt({"insecure": True})  # this check's own loopback channel to the receiver it starts
    name = "qwen2-10m" if cpu_mode else "qwen2.5-0.5b"
    config = model_configs()[name]
    model = Qwen2ForCausalLM(config, seed=None)
    model.init_weights(0, std=0.02)
    store = VersionStore(shm=False)
    for req in push_requests(model, version=0, rank=0, world_size=1):
        buf = store.buffer_for(req)
        for i, chunk in enumerate(req.shards):
            buf.add_chunk(0, chunk, i)
    buf.ranks_done.add(0)
    plan = build_deployment_plan(buf.layout(), config, Layout(1, "hf"), 64 << 20)
    (rank_plan,) = plan.ranks
    # A receiver on loopback, started by this check alone: no certificates to check it against.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "LOOPRL_INSECURE_PLAINTEXT": "true", "PYTHONPATH": path}
    child = subprocess.Popen(
        [sys.executable, "-m", "tools.gpu_weight_transport", json.dumps(config.to_dict()), device],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        if not line.startswith("ADDRESS "):
            raise RuntimeError(f"the receiver did not start: {line!r}")
        endpoint = Endpoint(line.split()[1], 0, "check")

        async def deliver() -> tuple[float, int, int]:
            transport = _transport(device)
            try:
                buckets = [PlannedBucket(spec, rank_plan.dtype, buf.chunks) for spec in rank_plan.buckets]
                started = time.perf_counter()
                (result,) = (await transport.stage(Delivery(0, buckets), [endpoint])).values()
                seconds = time.perf_counter() - started
                if result.error is not None or not result.complete:
                    raise RuntimeError(f"staging failed: {result.error}")
                committed = await transport.commit(endpoint, 0)
                return seconds, committed, sum(b.nbytes for b in buckets)
            finally:
                await transport.close()

        seconds, committed, nbytes = asyncio.run(deliver())
        child.stdin.write("digests\n")
        child.stdin.flush()
        reply = json.loads(child.stdout.readline().split(" ", 1)[1])
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    # The receiver holds its layout's parameters (a tied lm_head is embed_tokens, never sent twice).
    want = _digests(model.state_dict())
    got = reply["digests"]
    equal = [k for k, v in got.items() if want.get(k) == v]
    copy_gbps = _device_copy_gb_per_s(nbytes, device)
    gbps = nbytes / seconds / 1e9
    result = {
        "model": name,
        "transport": "cuda_ipc" if device == "cuda" else "grpc",
        "bytes": nbytes,
        "stage_seconds": seconds,
        "gb_per_s": gbps,
        "device_copy_gb_per_s": copy_gbps,
        "fraction_of_device_copy": gbps / copy_gbps,
        "committed_version": committed,
        "tensors_equal": len(equal),
        "tensors": len(got),
    }
    print(
        f"   {result['transport']}: {nbytes / 1e6:.1f} MB staged in {seconds:.3f}s = {gbps:.2f} GB/s, "
        f"{gbps / copy_gbps:.1%} of a {'device' if device == 'cuda' else 'memory'} copy ({copy_gbps:.1f} GB/s); "
        f"{len(equal)}/{len(got)} tensors equal after commit"
    )
    if committed != 0 or not got or len(equal) != len(got):
        result.update(status="failed", why="the receiver does not hold exactly the sent weights")
    return result


def _device_copy_gb_per_s(nbytes: int, device: str) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = synchronize(device) or (lambda: None)
    sync()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


if __name__ == "__main__":
    receiver_main(sys.argv[1], sys.argv[2])
