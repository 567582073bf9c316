"""Weight delivery across namespace hosts: NATS and weight-sync on host 1, a receiver on host 1 and
two on host 2 (one of them registered as if it were on host 1). Weight-sync must use shared memory
only within host 1 and gRPC over the veth to host 2, whatever a registration claims; the byte
counts per transport and host are printed and checked against what the receivers saw."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request

import grpc
import pytest
import torch

from bench.harness import netns_hosts
from bench.harness.multihost import PY, start_engine, wait_listening, wait_served, wait_serving
from bench.harness.synthetic_weights import rank_requests
from looprl.common.v1 import common_pb2
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.bus import subjects
from services.kit.local.infra import _bin
from services.modeling.config import ModelConfig
from services.modeling.qwen2 import Qwen2ForCausalLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = ModelConfig.tiny()
NATS_PORT, WS_PORT, WS_METRICS = 4222, 50071, 50072


def model_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in Qwen2ForCausalLM(CONFIG).named_parameters()}


async def deliver(ws_address: str, receivers: dict[str, tuple[str, str]], versions: int):
    async with grpc.aio.insecure_channel(ws_address) as channel:
        stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
        for name, (address, host_id) in receivers.items():
            await stub.RegisterTarget(
                weightsync_pb2.RegisterTargetRequest(
                    deployment=name,
                    every_k_versions=1,
                    ranks=[
                        weightsync_pb2.TargetRank(
                            rank=0, address=address, host_id=host_id, replica=f"{name}-r0"
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
            reqs = rank_requests(
                model_state(version),
                version=version,
                rank=0,
                world=1,
                max_message_bytes=1 << 16,
                model_config_json=config_json,
            )
            await stub.PushShards(iter(list(reqs)), timeout=60)
            reply, states = await wait_served(stub, version, receivers)
        return reply, states


async def published_events(nats_url: str) -> int:
    import nats

    nc = await nats.connect(nats_url, connect_timeout=10)
    try:
        return (await nc.jetstream().stream_info(subjects.WEIGHTS)).state.messages
    finally:
        await nc.close()


def delivered_metric(metrics_url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("looprl_weight_sync_delivered_bytes_total{"):
            labels, value = line[line.index("{") + 1 :].split("} ")
            parts = dict(p.split("=", 1) for p in labels.split(","))
            out[(parts["transport"].strip('"'), parts["host"].strip('"'))] = float(value)
    return out


async def test_shared_memory_within_a_host_and_grpc_across_hosts():
    netns_hosts.require()
    with netns_hosts.namespace_hosts(2) as hosts:
        h1 = hosts[1].address
        nats_proc = hosts.popen(
            1,
            [_bin("nats-server"), "-js", "-a", h1, "-p", str(NATS_PORT), "-sd", "/tmp/nats"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(h1, NATS_PORT, nats_proc, "nats-server")
        env = {k: v for k, v in os.environ.items() if k != "LOOPRL_SHM_DIR"}
        env.update(
            {
                "LOOPRL_WEIGHTSYNC_HOST": h1,
                "LOOPRL_WEIGHTSYNC_GRPC_PORT": str(WS_PORT),
                "LOOPRL_WEIGHTSYNC_METRICS_PORT": str(WS_METRICS),
                "LOOPRL_WEIGHTSYNC_NATS_URL": f"nats://{h1}:{NATS_PORT}",
                "LOOPRL_WEIGHTSYNC_GRACE_SECONDS": "2",
                "LOOPRL_WEIGHTSYNC_BUCKET_BYTES": str(1 << 16),
            }
        )
        ws_proc = hosts.popen(
            1,
            [PY, "-m", "services.weight_sync"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        engines = {
            "near": start_engine(hosts, 1),
            "far": start_engine(hosts, 2),
            "impostor": start_engine(hosts, 2),
        }
        wait_serving(h1, WS_PORT, ws_proc, "weight-sync")
        host1_id, host2_id = engines["near"][2], engines["far"][2]
        assert host1_id != host2_id == engines["impostor"][2]
        # The impostor is registered with host 1's identity: only the probe can tell.
        claims = {"near": host1_id, "far": host2_id, "impostor": host1_id}
        reply, states = await deliver(
            f"{h1}:{WS_PORT}", {n: (e[1], claims[n]) for n, e in engines.items()}, 2
        )

        assert reply.host_id == host1_id  # weight-sync and the near engine share host 1
        routes = {name: states[name].routes[0] for name in engines}
        hostname = {host1_id: "host1", host2_id: "host2"}
        for name, route in routes.items():
            real = hostname[engines[name][2]]
            print(
                f"{name:9s} on {real}: {route.transport:4s} {route.bytes_delivered:8d} bytes  ({route.reason})"
            )
        assert routes["near"].transport == "shm"
        assert routes["far"].transport == "grpc" and "other host" in routes["far"].reason
        assert routes["impostor"].transport == "grpc" and routes["impostor"].reason.startswith(
            "probe failed: NOT_FOUND"
        )
        metric = delivered_metric(f"http://{h1}:{WS_METRICS}/metrics")
        for (transport, host), value in sorted(metric.items()):
            print(
                f"looprl_weight_sync_delivered_bytes_total{{transport={transport}, host={hostname[host]}}} {value:.0f}"
            )
        assert metric[("shm", host1_id)] == routes["near"].bytes_delivered > 0
        assert metric[("grpc", host2_id)] == routes["far"].bytes_delivered > 0
        assert metric[("grpc", host1_id)] == routes["impostor"].bytes_delivered > 0  # labelled with its claim
        assert await published_events(f"nats://{h1}:{NATS_PORT}") == 2 * len(engines)

        seen = {}
        for name, (proc, _, _) in engines.items():
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
            seen[name] = next(line.split()[1:] for line in out.splitlines() if line.startswith("WEIGHTS"))
        print("receivers (version, bytes, of which from shared memory):", seen)
        assert all(int(v) == 1 for v, _, _ in seen.values())
        assert int(seen["near"][2]) == int(seen["near"][1]) > 0
        assert int(seen["far"][2]) == 0 < int(seen["far"][1])
        assert int(seen["impostor"][2]) == 0 < int(seen["impostor"][1])
    left = hosts.leftovers()
    assert left == {"namespaces": [], "interfaces": [], "processes": []}, left


def ray_node(hosts, host: int, env: dict[str, str]) -> subprocess.Popen:
    """A Ray head on host 1, a worker joined to it (`ray start --address`) elsewhere; 1 CPU each."""
    here = hosts[host].address
    role = (
        ["--head", "--port=6379", "--include-dashboard=false"]
        if host == 1
        else [f"--address={hosts[1].address}:6379"]
    )
    return hosts.popen(
        host,
        [
            _bin("ray"),
            "start",
            "--block",
            *role,
            "--num-cpus=1",
            f"--node-ip-address={here}",
            "--disable-usage-stats",
            "--temp-dir=/tmp/ray",
            "--object-store-memory=100000000",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_router_replicas_on_two_ray_nodes_get_shm_on_weight_syncs_host_and_grpc_elsewhere(tmp_path):
    """The real path: the router (host 1) places one replica per Ray node, each binds its node's
    address (replica_host = node) and reports its host identity, the router registers them with
    weight-sync (host 1), which sends host 1's replica shared memory and host 2's gRPC."""
    from looprl.inference.v1 import inference_pb2, inference_pb2_grpc

    netns_hosts.require()
    with netns_hosts.namespace_hosts(2) as hosts:
        h1 = hosts[1].address
        env = {k: v for k, v in os.environ.items() if k not in ("LOOPRL_SHM_DIR", "RAY_ADDRESS")}
        env.update(
            {
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": "looprl-multihost-test",
                "RAY_USAGE_STATS_ENABLED": "0",
            }
        )
        nats_proc = hosts.popen(
            1,
            [_bin("nats-server"), "-js", "-a", h1, "-p", str(NATS_PORT), "-sd", "/tmp/nats"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        head = ray_node(hosts, 1, env)
        wait_listening(h1, 6379, head, "ray head")
        ray_node(hosts, 2, env)
        wait_listening(h1, NATS_PORT, nats_proc, "nats-server")
        ws_env = {
            **env,
            "LOOPRL_WEIGHTSYNC_HOST": h1,
            "LOOPRL_WEIGHTSYNC_GRPC_PORT": str(WS_PORT),
            "LOOPRL_WEIGHTSYNC_METRICS_PORT": str(WS_METRICS),
            "LOOPRL_WEIGHTSYNC_USE_BUS": "false",
        }
        ws_proc = hosts.popen(
            1,
            [PY, "-m", "services.weight_sync"],
            env=ws_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_serving(h1, WS_PORT, ws_proc, "weight-sync")
        deployments = [{"name": "d", "replicas": 2, "max_model_len": 64, "max_batch_size": 4}]
        router_env = {
            **env,
            **{
                f"LOOPRL_INFERENCE_ROUTER_{k}": v
                for k, v in {
                    "HOST": h1,
                    "GRPC_PORT": "50081",
                    "METRICS_PORT": "50082",
                    "RAY_ADDRESS": f"{h1}:6379",
                    "NATS_URL": f"nats://{h1}:{NATS_PORT}",
                    "WEIGHT_SYNC_ADDRESS": f"{h1}:{WS_PORT}",
                    "DEPLOYMENTS": json.dumps(deployments),
                    "REPLICA_HOST": "node",
                    "STATUS_INTERVAL_S": "0.2",
                    "GRACE_SECONDS": "3",
                }.items()
            },
        }
        router_log = open(tmp_path / "router.log", "w")  # noqa: SIM115
        router = hosts.popen(
            1,
            [PY, "-m", "services.inference_router"],
            env=router_env,
            stdout=router_log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_listening(h1, 50081, router, "router", timeout=180)
            async with grpc.aio.insecure_channel(f"{h1}:{WS_PORT}") as channel:
                stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
                deadline = time.monotonic() + 180
                while (
                    len((await stub.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=10)).targets) < 2
                ):
                    assert time.monotonic() < deadline and router.poll() is None, "replicas never registered"
                    await asyncio.sleep(0.5)
                reqs = rank_requests(
                    model_state(0),
                    version=0,
                    rank=0,
                    world=1,
                    max_message_bytes=1 << 16,
                    model_config_json=json.dumps(CONFIG.to_hf_dict()),
                )
                await stub.PushShards(iter(list(reqs)), timeout=60)
                while True:
                    reply = await stub.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=10)
                    if all(t.version == 0 and t.state == "ready" for t in reply.targets):
                        break
                    assert time.monotonic() < deadline, f"version 0 not delivered: {reply}"
                    await asyncio.sleep(0.2)
            routes = {r.address.rsplit(":", 1)[0]: r for t in reply.targets for r in t.routes}
            for ip, route in sorted(routes.items()):
                host = "host1" if ip == h1 else "host2" if ip == hosts[2].address else ip
                print(
                    f"{route.replica} on {host}: {route.transport} {route.bytes_delivered} bytes ({route.reason})"
                )
            assert set(routes) == {h1, hosts[2].address}, routes  # one replica per Ray node
            assert routes[h1].transport == "shm" and routes[h1].host_id == reply.host_id
            assert (
                routes[hosts[2].address].transport == "grpc"
                and "other host" in routes[hosts[2].address].reason
            )
            async with grpc.aio.insecure_channel(f"{h1}:50081") as channel:
                router_stub = inference_pb2_grpc.InferenceRouterServiceStub(channel)
                served = set()
                for i in range(8):
                    request = inference_pb2.GenerateRequest(
                        prompt_token_ids=[4, 5, 6 + i],
                        min_weight_version=0,
                        sampling=common_pb2.SamplingParams(max_tokens=2),
                    )
                    response = await router_stub.Generate(request, timeout=60)
                    assert response.completions[0].weight_version == 0
                    served.add(response.replica)
            print("served by", sorted(served))
        except BaseException:
            router_log.flush()
            print((tmp_path / "router.log").read_text()[-6000:])
            raise
        finally:
            router_log.close()
    left = hosts.leftovers()
    assert left == {"namespaces": [], "interfaces": [], "processes": []}, left
