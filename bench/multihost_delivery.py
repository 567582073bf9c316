"""Weight delivery across hosts: the same model, in the same run, delivered by weight-sync to a
receiver on its own host (shared memory) and to one on another namespace host (gRPC over the
veth). Version 0 goes to both (first plan, first connections: a warm-up); after it the versions
alternate between the two receivers, so each delivery is timed alone and the two sides interleave
in time. The figure is the veth receiver's sync seconds per version against the same-host
receiver's (medians): weight-sync's own measure, from the version's first bytes to the receiver
serving it, so the trainer-side push (pipelined with the delivery) is inside both.

Needs root (network and mount namespaces, bench/harness/netns_hosts.py).

    python -m bench.multihost_delivery [--quick]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess

import grpc

from bench.common import emit, parse_args
from bench.harness import netns_hosts
from bench.harness.multihost import PY, start_engine, wait_served, wait_serving
from bench.harness.synthetic_weights import rank_requests
from looprl.common.v1 import common_pb2
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.modeling.config import ModelConfig
from services.modeling.layouts import hf_params

WS_PORT = 50071
# ~100 MB of float32 weights: large enough that bytes, not per-call overheads, decide.
CONFIG = ModelConfig.tiny(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)


def state(version: int):
    import torch

    torch.manual_seed(version)
    return {name: torch.randn(shape) for name, shape in hf_params(CONFIG).items()}


async def deliveries(address: str, receivers: dict[str, tuple[str, str]], versions: int) -> dict[str, list]:
    """Push `versions` versions: version 0 to every receiver (the warm-up), then each version to one
    receiver in turn (the other's registration asks only for every millionth version), so each
    delivery is timed alone. Each receiver's (version, sync seconds, bytes, transport)."""
    seen: dict[str, list] = {name: [] for name in receivers}
    names = list(receivers)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)

        async def register(name: str, every_k: int) -> None:
            endpoint, host_id = receivers[name]
            await stub.RegisterTarget(
                weightsync_pb2.RegisterTargetRequest(
                    deployment=name,
                    every_k_versions=every_k,
                    ranks=[
                        weightsync_pb2.TargetRank(
                            rank=0, address=endpoint, host_id=host_id, replica=f"{name}-r0"
                        )
                    ],
                    layout=weightsync_pb2.TargetLayout(
                        tensor_parallel=1, naming="hf", dtype=common_pb2.D_TYPE_FLOAT32
                    ),
                ),
                timeout=30,
            )

        config_json = json.dumps(CONFIG.to_hf_dict())
        for version in range(versions):
            due = names if version == 0 else [names[(version - 1) % len(names)]]
            for name in names:
                await register(name, 1 if name in due else 10**6)
            reqs = list(
                rank_requests(state(version), version=version, rank=0, world=1, model_config_json=config_json)
            )
            await stub.PushShards(iter(reqs), timeout=120)
            _, targets = await wait_served(stub, version, due, timeout=120)
            for name in due:
                t = targets[name]
                seen[name].append((version, t.last_sync_seconds, t.last_bytes, t.routes[0].transport))
    return seen


def main() -> None:
    args = parse_args(__doc__)
    versions = 5 if args.quick else 13
    reason = netns_hosts.unavailable()
    if reason is not None:
        raise SystemExit(f"multihost_delivery: {reason}")
    with netns_hosts.namespace_hosts(2) as hosts:
        h1 = hosts[1].address
        env = {k: v for k, v in os.environ.items() if k != "LOOPRL_SHM_DIR"}
        env.update(
            {
                "LOOPRL_WEIGHTSYNC_HOST": h1,
                "LOOPRL_WEIGHTSYNC_GRPC_PORT": str(WS_PORT),
                "LOOPRL_WEIGHTSYNC_METRICS_PORT": str(WS_PORT + 1),
                "LOOPRL_WEIGHTSYNC_USE_BUS": "false",
            }
        )
        ws = hosts.popen(
            1,
            [PY, "-m", "services.weight_sync"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        engines = {"same-host": start_engine(hosts, 1, CONFIG), "other-host": start_engine(hosts, 2, CONFIG)}
        wait_serving(h1, WS_PORT, ws, "weight-sync")
        seen = asyncio.run(
            deliveries(f"{h1}:{WS_PORT}", {n: (e[1], e[2]) for n, e in engines.items()}, versions)
        )
    left = hosts.leftovers()
    if any(left.values()):
        raise RuntimeError(f"namespace hosts left behind: {left}")
    for name, rows in seen.items():
        print(
            f"{name:10s} "
            + "  ".join(f"v{v} {s * 1e3:6.1f} ms {b / s / 1e9:5.2f} GB/s {t}" for v, s, b, t in rows)
        )
    transports = {name: {t for *_, t in rows} for name, rows in seen.items()}
    if transports != {"same-host": {"shm"}, "other-host": {"grpc"}}:
        raise RuntimeError(f"unexpected transports: {transports}")
    near = statistics.median(s for _, s, _, _ in seen["same-host"][1:])
    far = statistics.median(s for _, s, _, _ in seen["other-host"][1:])
    nbytes = seen["other-host"][-1][2]
    emit(
        "multihost_delivery", "veth_grpc_over_same_host_shm_seconds", far, near, far / near, "s", "reference"
    )
    emit(
        "multihost_delivery",
        "veth_grpc_gb_per_s",
        nbytes / far / 1e9,
        nbytes / near / 1e9,
        near / far,
        "GB/s",
        "reference",
    )


if __name__ == "__main__":
    main()
