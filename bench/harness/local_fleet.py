"""Running the inference-router locally: a tiny model's weights, loading them into replicas, and
the router as a real subprocess. Used by integration tests and benchmarks (not by the service).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.kit.local.infra import free_port, stop_process_group
from services.kit.rpc import tls

REPO_ROOT = Path(__file__).resolve().parents[2]  # bench/harness/ -> the repository


def tiny_checkpoint(seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """(ModelConfig, full HF state dict) of a freshly initialised tiny Qwen2."""
    import torch

    from services.modeling.config import ModelConfig
    from services.modeling.qwen2 import Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = ModelConfig.tiny()
    model = Qwen2ForCausalLM(config)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def replica_actor(deployment: str, index: int, namespace: str) -> Any:
    import ray

    return ray.get_actor(f"{deployment}/{index}", namespace=namespace)


def load_weights(actor: Any, config: Any, state_dict: dict[str, Any], version: int) -> Any:
    """Load a full HF state dict as `version` into one replica (all its TP ranks); an ObjectRef."""
    return actor.load_state_dict.remote(version, state_dict, config.to_dict())


class RouterProcess:
    """`python -m services.inference_router` as a child process, joined to the exported Ray head."""

    def __init__(self, deployments: list[dict], log_path: Path, **settings: Any) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.namespace = f"router-{self.port}"
        env = dict(os.environ)
        env.update(
            {
                "LOOPRL_INFERENCE_ROUTER_GRPC_PORT": str(self.port),
                "LOOPRL_INFERENCE_ROUTER_METRICS_PORT": str(self.metrics_port),
                "LOOPRL_INFERENCE_ROUTER_GRACE_SECONDS": str(settings.pop("grace_seconds", 3)),
                "LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS": json.dumps(deployments),
                "LOOPRL_INFERENCE_ROUTER_NAMESPACE": self.namespace,
                "LOOPRL_INFERENCE_ROUTER_NATS_URL": settings.pop("nats_url", "nats://127.0.0.1:1"),
                "PYTHONPATH": str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            }
        )
        for key, value in settings.items():
            env[f"LOOPRL_INFERENCE_ROUTER_{key.upper()}"] = str(value)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - kept open for the child's lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.inference_router"],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 120.0) -> RouterProcess:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with tls.sync_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"router not SERVING within {timeout:.0f}s:\n{self.tail()}")

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one Prometheus sample of the router (0 when absent)."""
        import urllib.request

        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name + "{" if labels else name + " "):
                sample, value = line.rsplit(" ", 1)
                got = sample[len(name) :].strip("{}")
                if not labels or ",".join(sorted(got.split(","))) == want:
                    return float(value)
        return 0.0

    def tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        stop_process_group(self.proc, grace=15)
        self._log.close()
