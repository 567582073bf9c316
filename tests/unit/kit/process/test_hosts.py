"""Host identity and advertised addresses (services/kit/process/hosts.py, services/kit/config/service.py)."""

from __future__ import annotations

import subprocess
import sys

from services.kit.config.service import ServiceConfig, advertised_host, load_config
from services.kit.process.hosts import host_identity, host_parts, primary_address

IDENTITY = "from services.kit.process.hosts import host_identity; print(host_identity())"


def identity_in_subprocess(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", IDENTITY], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_processes_of_one_host_agree_and_another_shm_directory_is_another_host(tmp_path, monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "LOOPRL_SHM_DIR"}
    here = identity_in_subprocess(env)
    assert here == host_identity() == identity_in_subprocess(env)
    elsewhere = identity_in_subprocess({**env, "LOOPRL_SHM_DIR": str(tmp_path)})
    assert elsewhere != here
    monkeypatch.setenv("LOOPRL_SHM_DIR", str(tmp_path))
    assert host_parts()["shm"].startswith(f"{tmp_path}:")


def test_advertised_host_is_the_bind_address_unless_told_or_bound_everywhere():
    assert advertised_host(ServiceConfig()) == "127.0.0.1"
    assert advertised_host(ServiceConfig(host="10.1.2.3")) == "10.1.2.3"
    assert (
        advertised_host(ServiceConfig(host="0.0.0.0", advertise_host="node-7.internal")) == "node-7.internal"
    )
    everywhere = advertised_host(ServiceConfig(host="0.0.0.0"))
    assert everywhere == primary_address() and everywhere not in ("0.0.0.0", "")
    config = load_config(ServiceConfig, "ROUTER", {"LOOPRL_ROUTER_ADVERTISE_HOST": "10.9.8.7"})
    assert config.advertise_host == "10.9.8.7"
