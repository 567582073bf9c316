"""The NATS credentials a deployment mounts: what `looprl certs` writes and how a service reads it."""

from __future__ import annotations

import stat

import pytest

from services.kit.bus import nats_auth
from services.kit.bus.client import redact
from services.kit.config.service import ConfigError, ServiceConfig, bus_url


def test_certs_write_a_server_config_and_one_private_credentials_file_per_user(tmp_path) -> None:
    passwords = nats_auth.write_credentials(tmp_path, ["gateway", "trainer"])
    assert set(passwords) == {"gateway", "trainer", nats_auth.OPERATOR}
    conf = (tmp_path / "nats-server.conf").read_text()
    for user, password in passwords.items():
        creds = tmp_path / f"nats-{user}.creds"
        assert creds.read_text().strip() == f"{user}:{password}" and password in conf
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    # the trainer may not publish episodes; the gateway may
    assert "looprl.*.episodes" in nats_auth.denied("trainer") and "looprl.*.episodes" not in nats_auth.denied(
        "gateway"
    )


def test_a_service_adds_its_mounted_credentials_to_the_nats_url_and_never_logs_them(tmp_path) -> None:
    creds = tmp_path / "nats.creds"
    creds.write_text("trainer:s3cret\n")
    cfg = ServiceConfig(nats_url="nats://nats:4222", nats_credentials_file=str(creds))
    assert bus_url(cfg) == "nats://trainer:s3cret@nats:4222"
    assert redact(bus_url(cfg)) == "nats://nats:4222"
    assert bus_url(ServiceConfig(nats_url="nats://nats:4222")) == "nats://nats:4222"
    creds.write_text("no-colon")
    with pytest.raises(ConfigError, match="nats_credentials_file"):
        bus_url(cfg)
    with pytest.raises(ConfigError, match="nats_credentials_file: cannot read"):
        bus_url(ServiceConfig(nats_credentials_file=str(tmp_path / "missing")))
