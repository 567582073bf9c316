"""The local stack's infrastructure processes really start, serve and stop."""

import asyncio
import contextlib

import nats
import pytest

from services.kit.local.infra import NatsServer, PortInUseError, RayHead, session_pids


def test_nats_server_serves_jetstream(nats_url: str) -> None:
    async def roundtrip() -> bytes:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_stream(name="INFRA", subjects=["infra.>"])
        await js.publish("infra.x", b"hello")
        msg = await js.get_last_msg("INFRA", "infra.x")
        await nc.close()
        return msg.data

    assert asyncio.run(roundtrip()) == b"hello"


def test_port_in_use_is_a_clear_error(nats_server: NatsServer, tmp_path) -> None:
    with pytest.raises(PortInUseError, match=f"port {nats_server.port} is already in use"):
        NatsServer(state_dir=tmp_path, port=nats_server.port).start()


@pytest.mark.slow
def test_ray_head_runs_tasks(ray_client: None) -> None:
    import ray

    @ray.remote
    def square(x: int) -> int:
        return x * x

    assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]


@pytest.mark.slow
def test_the_ray_head_starts_no_client_or_api_server(ray_head: RayHead) -> None:
    commands = []
    for pid in session_pids(ray_head.proc.pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            commands.append(f.read().replace(b"\0", b" ").decode())
    assert any("raylet" in c for c in commands), commands  # the head's own session
    assert not [c for c in commands if "ray.util.client.server" in c or "dashboard/dashboard.py" in c]
