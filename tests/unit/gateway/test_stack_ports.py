"""`looprl up`'s ports and environments: its default ports lie below the kernel's ephemeral range
(where an outgoing connection can take a port between the check that it is free and the bind), and
each service is given only the secrets it needs: the Ray cluster's token the Ray drivers, the users'
tokens the gateway."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from gateway.stack import ServiceProcess, StackPorts, StackState, in_ephemeral_range, service_environment
from services.kit.config import registry
from services.kit.local.infra import RAY_VARIABLES, USER_TOKEN_VARIABLES, ephemeral_range


def test_up_listens_below_the_kernels_ephemeral_range_by_default() -> None:
    args = build_parser().parse_args(["up"])
    low, _ = ephemeral_range()  # this host's (/proc/sys/net/ipv4/ip_local_port_range)
    ports = {"nats": args.nats_port, "http": args.http_port}
    ports |= {f"ray+{i}": args.ray_port + i for i in range(7)}  # the head's GCS and its six other ports
    ports |= {f"grpc {s.name}": args.base_port + i for i, s in enumerate(registry.SERVICES)}
    ports |= {f"metrics {s.name}": args.base_port + 100 + i for i, s in enumerate(registry.SERVICES)}
    inside = {what: port for what, port in ports.items() if port >= min(low, 32768)}
    assert inside == {}, f"ports of `looprl up` in the ephemeral range ({low}+)"
    ray_workers = {what: port for what, port in ports.items() if 10002 <= port <= 19999}
    assert ray_workers == {}, "ports in Ray's worker port range"
    assert (args.nats_port, args.ray_port, args.base_port, args.http_port) == tuple(
        getattr(StackPorts(), name) for name in ("nats", "ray", "base", "http")
    )
    planned = StackPorts().planned()
    assert len(set(planned.values())) == len(planned) == 2 + 7 + 2 * len(registry.SERVICES)
    assert in_ephemeral_range(planned) == {}
    assert in_ephemeral_range(StackPorts(base=50050).planned())["gateway gRPC"] == 50056


def stack() -> StackState:
    return StackState(
        state_dir="/tmp/nowhere",
        nats_port=1,
        nats_pid=1,
        ray_port=26379,
        ray_pid=1,
        ray_token="the-ray-token",
        gateway_token="the-gateway-token",
        http_port=2,
        service_env={"LOOPRL_STATE_DIR": "/tmp/nowhere"},
    )


def test_only_ray_drivers_get_the_ray_token_and_only_the_gateway_the_users_tokens(monkeypatch) -> None:
    # The caller's environment may hold both (the test suite's does): neither leaks to a service
    # that does not need it.
    for name in RAY_VARIABLES + USER_TOKEN_VARIABLES:
        monkeypatch.setenv(name, f"callers-{name}")
    state = stack()
    for spec in registry.SERVICES:
        env = service_environment(state, ServiceProcess(spec.name, 0, 3, 4, "log", spec.package))
        ray = {k: v for k, v in env.items() if k in RAY_VARIABLES}
        users = {k for k in env if k in USER_TOKEN_VARIABLES}
        if spec.ray_driver:
            assert ray["RAY_AUTH_TOKEN"] == "the-ray-token" and ray["RAY_ADDRESS"] == "127.0.0.1:26379"
        else:
            assert ray == {}, spec.name
        if spec.name == "gateway":
            assert env["LOOPRL_GATEWAY_TOKENS"] == "the-gateway-token"  # the stack's, which `up` prints
            assert env["LOOPRL_GATEWAY_TENANTS"] == "callers-LOOPRL_GATEWAY_TENANTS"
        else:
            assert users == set(), spec.name
    drivers = {s.name for s in registry.SERVICES if s.ray_driver}
    assert drivers == {"inference-router", "reward", "environment-sandbox", "trainer"}


@pytest.mark.parametrize("name", ["weight-sync", "rollout-packer", "gateway"])
def test_services_that_use_no_ray_never_see_its_address(name: str, monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = service_environment(stack(), ServiceProcess(name, 0, 3, 4, "log", registry.service(name).package))
    assert not set(env) & set(RAY_VARIABLES)
