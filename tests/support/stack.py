"""Local stacks for e2e and chaos tests, brought up and down through the `looprl` CLI exactly as a
user does (`looprl up`, `looprl down`); the fixtures are re-exported by their conftest files."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.stack import StackState
from looprl.gateway.v1 import gateway_pb2_grpc
from services.kit.local.infra import pid_alive, port_is_free, ray_temp_dir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = (ROOT / "configs" / "digits_grpo.toml").read_text()


@dataclass
class Stack:
    state: StackState
    stub: gateway_pb2_grpc.GatewayServiceStub
    metadata: tuple[tuple[str, str], ...]
    state_dir: Path

    def looprl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return looprl_cli(self.state_dir, *args, timeout=timeout)


def looprl_cli(state_dir: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--state-dir", str(state_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _free_base() -> int:
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(21000, 25800)  # clear of client sockets (32768+) and Ray workers (10002-19999)
        if all(port_is_free(base + i) and port_is_free(base + 100 + i) for i in range(8)):
            return base
    raise RuntimeError("no free port range for the stack")


def _free_port(lo: int, hi: int) -> int:
    return next(p for p in random.sample(range(lo, hi), 500) if port_is_free(p))


def _free_ray_port() -> int:
    """A head port whose six neighbours (the head's other ports) are free too."""
    for port in random.sample(range(27000, 27990), 500):
        if all(port_is_free(p) for p in range(port, port + 7)):
            return port
    raise RuntimeError("no free port range for the Ray head")


def free_port_args() -> list[str]:
    """`looprl up`'s (and `looprl run --local`'s) port options, on ports free right now."""
    return [
        "--nats-port",
        str(_free_port(26000, 26500)),
        "--ray-port",
        str(_free_ray_port()),
        "--base-port",
        str(_free_base()),
        "--http-port",
        str(_free_port(26500, 27000)),
    ]


def assert_stack_gone(state: StackState) -> None:
    """Nothing the stack started is left: no process, no Ray session in /tmp."""
    pids = [state.nats_pid, state.ray_pid, *(s.pid for s in state.services)]
    assert not [pid for pid in pids if pid_alive(pid)], "processes left after the stack came down"
    assert not _ray_processes(state.ray_port), "Ray processes left after the stack came down"
    assert not ray_temp_dir(state.ray_port).exists(), "Ray's session left in /tmp after the stack came down"


def _ray_processes(port: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"looprl-ray-{port}" in line]


@contextmanager
def local_stack(
    state_dir: Path, recipe_text: str | None = None, up_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """`looprl up` on free ports, yielding the Stack; `looprl down` after, checking nothing is left.
    `recipe_text`: the recipe whose deployments the stack serves from the start; None: none, every
    run brings its own. `up_args`: more options of `looprl up` (e.g. --plugin-dir, --use)."""
    recipe_args = []
    if recipe_text is not None:
        recipe = state_dir / "recipe.toml"
        recipe.write_text(recipe_text)
        recipe_args = ["--recipe", str(recipe)]
    started = looprl_cli(state_dir, "up", *recipe_args, *up_args, *free_port_args())
    assert started.returncode == 0, started.stdout + started.stderr
    state = StackState.load(state_dir.resolve())
    assert state is not None
    channel = grpc.insecure_channel(
        state.service("gateway").address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    try:
        yield Stack(
            state,
            gateway_pb2_grpc.GatewayServiceStub(channel),
            (("authorization", f"Bearer {state.gateway_token}"),),
            state_dir,
        )
    finally:
        channel.close()
        stopped = looprl_cli(state_dir, "down")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert_stack_gone(state)
        assert (state_dir / "ray-logs").is_dir(), "the Ray session's logs were not kept with the stack"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack shared by the tests that start no run: it serves the default recipe's deployments
    from the start, so requests reach a replica."""
    with local_stack(tmp_path_factory.mktemp("stack"), DEFAULT_RECIPE) as s:
        yield s


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for a test whose run must be the only one on it."""
    with local_stack(tmp_path) as s:
        yield s
