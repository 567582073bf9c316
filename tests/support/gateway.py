"""The gateway as a real child process against a real nats-server, and calls to its HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from looprl.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.kit.local.infra import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


class GatewayProcess:
    def __init__(self, nats_url: str, tmp: Path, router_address: str = "") -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.env = {
            **os.environ,
            "LOOPRL_GATEWAY_GRPC_PORT": str(self.grpc_port),
            "LOOPRL_GATEWAY_HTTP_PORT": str(self.http_port),
            "LOOPRL_GATEWAY_TOKENS": f"other,{TOKEN}",
            "LOOPRL_NATS_URL": nats_url,
            "LOOPRL_STATE_DIR": str(tmp),
            # protos/ too: a git worktree's generated code, not the editable install's checkout.
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")]),
        }
        if router_address:
            self.env["LOOPRL_GATEWAY_ROUTER_ADDRESS"] = router_address
        self.log = tmp / "gateway.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> GatewayProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway"], cwd=ROOT, env=self.env, stderr=log
            )
        wait_for_port(self.grpc_port, 30, self.proc, "gateway")
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=AUTH, timeout=2)
                return self
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    # What the gateway said is the only clue to why it never answered.
                    raise AssertionError(
                        f"the gateway never answered: {self.log.read_text()[-4000:]}"
                    ) from exc
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def http(gateway: GatewayProcess, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    """(status, JSON reply) of an authenticated call to the gateway's HTTP API."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}{path}", data=data)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def openai_error(reply: dict) -> dict:
    """The error object of an OpenAI-shaped error reply (and nothing else in the reply)."""
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    return reply["error"]
