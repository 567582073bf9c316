"""Session-wide infrastructure for the suite: one real nats-server and one real Ray head.

Both start lazily, the first time a test asks for them, and stop at the end of the session.
Tests that need neither never pay for them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kit.local.infra import NatsServer, RayHead, free_port

# Ray reads its auth settings when it is first imported, which may happen while test modules are
# collected, before any fixture runs: fix the session's token now, for the head and every client.
SESSION_RAY_TOKEN = secrets.token_hex(16)
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = SESSION_RAY_TOKEN
# In-process tests build servers and plain clients by hand, so they run without TLS (the kit logs
# a warning). Stacks started with `looprl up` (tests/support/stack.py) always use the certificates
# `up` issues, and tests/security checks mutual TLS and authorization on such a stack. Set before
# the Ray head starts, so that Ray workers created by these tests inherit it.
os.environ.setdefault("LOOPRL_INSECURE_PLAINTEXT", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on a free port."""
    server = NatsServer(state_dir=tmp_path_factory.mktemp("nats"), port=free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """A real Ray head (token auth on); its connection settings are exported to the environment
    so that ray.init() in tests and in service subprocesses joins it."""
    state_dir = tmp_path_factory.mktemp("ray")
    port = next(
        p for p in range(26400, 26500, 7) if all(_free(q) for q in RayHead(state_dir, p).ports().values())
    )
    head = RayHead(state_dir=state_dir, port=port, num_cpus=16, token=SESSION_RAY_TOKEN).start()
    saved = {k: os.environ.get(k) for k in head.env()}
    os.environ.update(head.env())
    yield head
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        head.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def ray_client(ray_head: RayHead) -> Iterator[None]:
    """This test process connected to the session's Ray head."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_head.address, namespace="looprl-tests", logging_level="ERROR")
    yield


def _free(port: int) -> bool:
    from services.kit.local.infra import port_is_free

    return port_is_free(port)


REPO_ROOT = Path(__file__).resolve().parent.parent
