"""`looprl up --use`: which parts are outside looprl, what the stack tells its services about them,
and the checks that keep a part that cannot stand in for its role from joining."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import external
from gateway.stack import PEER_VARIABLES
from services.kit.config.service import ConfigError, load_config
from services.kit.rpc import tls
from services.reward.config import RewardConfig


def test_a_part_is_a_role_an_address_and_the_identity_its_certificate_carries() -> None:
    assert external.parse("reward=10.0.0.5:7000") == external.ExternalPart(
        "reward", "10.0.0.5:7000", "reward"
    )
    assert external.parse("reward=host:7000@acme-reward").identity == "acme-reward"
    assert external.parse("inference-engine=127.0.0.1:7100").identity == ""  # any the CA issued
    for bad, said in (
        ("gateway=h:1", "ROLE one of"),
        ("reward", "ROLE=HOST:PORT"),
        ("reward=h", "is not HOST:PORT"),
        ("reward=h:99999", "is not HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=said):
            external.parse(bad)
    with pytest.raises(ValueError, match="names a service twice"):
        external.parse_all(["reward=h:1", "reward=h:2"])


def test_callers_get_the_address_and_a_foreign_identity_is_authorized_as_its_role() -> None:
    parts = external.parse_all(["reward=h:1@acme-reward", "trainer=h:2", "inference-engine=h:3"])
    env = external.service_env(parts, PEER_VARIABLES)
    assert env[PEER_VARIABLES["reward"]] == "h:1"
    assert json.loads(env["LOOPRL_EXTERNAL_IDENTITIES"]) == {"acme-reward": "reward"}
    assert "h:3" not in env.values()  # engines are registered with the router, not configured
    with pytest.raises(ValueError, match="give --recipe"):
        external.router_env(parts, None)
    assert external.router_env(parts, "r.toml") == {"LOOPRL_INFERENCE_ROUTER_WATCH_RUNS": "false"}
    assert external.router_env(parts[:1], None) == {}


def test_an_identity_may_not_stand_in_for_looprls_own_or_the_gateway() -> None:
    def config(value: dict) -> RewardConfig:
        return load_config(RewardConfig, "REWARD", {"LOOPRL_EXTERNAL_IDENTITIES": json.dumps(value)})

    assert config({"acme-reward": "reward"}).external_identities == {"acme-reward": "reward"}
    for bad in ({"trainer": "reward"}, {"operator": "reward"}, {"acme": "gateway"}, {"acme": "nobody"}):
        with pytest.raises(ConfigError, match="LOOPRL_EXTERNAL_IDENTITIES"):
            config(bad)


def test_a_caller_with_a_stand_in_identity_reads_as_its_role(tmp_path, monkeypatch) -> None:
    # configure() sets this process's identity: put it back after (other tests run plaintext).
    monkeypatch.setattr(tls, "_process", tls._process)
    monkeypatch.setattr(tls, "_stand_ins", dict(tls._stand_ins))
    cfg = load_config(
        RewardConfig,
        "REWARD",
        {
            "LOOPRL_TLS_DIR": str(tls.generate_dev_pki(tmp_path)),
            "LOOPRL_EXTERNAL_IDENTITIES": '{"acme-sandbox": "environment-sandbox"}',
        },
    )
    tls.configure("reward", cfg)

    class Context:
        def __init__(self, name: bytes) -> None:
            self.name = name

        def auth_context(self):
            return {"x509_common_name": [self.name]}

    assert tls.peer_identity(Context(b"acme-sandbox")) == "environment-sandbox"
    assert tls.peer_identity(Context(b"gateway")) == "gateway"


@pytest.fixture
def part_server(tmp_path):
    """A TLS server of the stack's CA presenting `reward`'s certificate, with health and reflection
    but no RewardService: it cannot stand in for the reward service."""
    pki = tls.generate_dev_pki(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port("127.0.0.1:0", tls.Credentials.from_dir("reward", pki).server_credentials())
    server.start()
    yield f"127.0.0.1:{port}", tls.Credentials.from_dir("operator", pki)
    server.stop(None)


def test_a_part_is_refused_naming_why(part_server) -> None:
    address, operator = part_server
    wrong_name = external.ExternalPart("reward", address, "acme-reward")
    assert external.problems(wrong_name, operator) == [
        "its certificate is issued to 'reward', not 'acme-reward'"
    ]
    [why] = external.problems(external.ExternalPart("reward", address, "reward"), operator)
    assert why.startswith("reflection does not list looprl.reward.v1.RewardService")
    with pytest.raises(TimeoutError, match=r"reward at 127\.0\.0\.1:\d+: reflection does not list"):
        external.wait_ready(
            [external.ExternalPart("reward", address, "reward")], operator, timeout=0.5, log=lambda *_: None
        )
