"""Mutual TLS and caller authorization on one real service process (the kit's probe serving
TrainerService as `trainer`), with certificates from the development CA `looprl up` uses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from looprl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.kit.config.service import ConfigError, ServiceConfig
from services.kit.local.infra import free_port, wait_for_port
from services.kit.rpc import tls

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tls.generate_dev_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def trainer_probe(pki: Path) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "LOOPRL_PROBE_IDENTITY": "trainer",
        "LOOPRL_PROBE_GRPC_PORT": str(port),
        "LOOPRL_TLS_DIR": str(pki),
        "LOOPRL_INSECURE_PLAINTEXT": "false",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.probe_service"], cwd=ROOT, env=env)
    wait_for_port(port, 30, proc, "probe service")
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def _status(channel: grpc.Channel) -> trainer_pb2.StatusResponse:
    return trainer_pb2_grpc.TrainerServiceStub(channel).Status(trainer_pb2.StatusRequest(), timeout=10)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_an_allowed_identity_is_served_and_health_is_open_to_any_certificate(trainer_probe, pki):
    with tls.sync_channel(trainer_probe, creds=tls.Credentials.from_dir("operator", pki)) as channel:
        assert _status(channel).step == 7
    with tls.sync_channel(trainer_probe, creds=tls.Credentials.from_dir("weight-sync", pki)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_another_services_identity_is_permission_denied(trainer_probe, pki):
    reward = tls.Credentials.from_dir("reward", pki)
    with tls.sync_channel(trainer_probe, creds=reward) as channel, pytest.raises(grpc.RpcError) as info:
        _status(channel)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'reward' may not call it" in info.value.details()
    # Checkpoint is the operator's alone, even for the gateway that may read Status.
    with tls.sync_channel(trainer_probe, creds=tls.Credentials.from_dir("gateway", pki)) as channel:
        assert _status(channel).step == 7
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        code = _code(lambda: stub.Checkpoint(trainer_pb2.CheckpointRequest(), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_callers_without_a_valid_certificate_never_get_a_connection(trainer_probe, pki, tmp_path):
    """What a client sees when the server's handshake refuses it: UNAVAILABLE, nothing served."""
    rogue = tls.generate_dev_pki(tmp_path / "rogue", ["operator"])  # right name, wrong CA
    ca = (pki / "ca.crt").read_bytes()
    channels = {
        "plaintext": grpc.insecure_channel(trainer_probe),
        "no client certificate": grpc.secure_channel(trainer_probe, grpc.ssl_channel_credentials(ca)),
        "certificate from another CA": tls.sync_channel(
            trainer_probe,
            creds=tls.Credentials(
                "operator", ca, (rogue / "operator.crt").read_bytes(), (rogue / "operator.key").read_bytes()
            ),
        ),
    }
    for what, channel in channels.items():
        with channel:
            assert _code(lambda c=channel: _status(c)) == grpc.StatusCode.UNAVAILABLE, what
            health = health_pb2_grpc.HealthStub(channel)
            code = _code(lambda h=health: h.Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE, what


def test_a_service_without_certificates_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPRL_")}
    env.update(PYTHONPATH=str(ROOT), LOOPRL_PACKER_GRPC_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "services.rollout_packer"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no TLS certificates configured" in done.stderr and "LOOPRL_TLS_DIR" in done.stderr
    with pytest.raises(ConfigError, match="tls_key_file not set"):
        tls.resolve("trainer", ServiceConfig(tls_ca_file="ca.crt", tls_cert_file="t.crt"))


def test_a_certificate_issued_to_another_service_is_refused(pki):
    with pytest.raises(ConfigError, match="issued to 'reward', not to 'trainer'"):
        tls.Credentials.from_files(
            "trainer", str(pki / "ca.crt"), str(pki / "reward.crt"), str(pki / "reward.key")
        )
