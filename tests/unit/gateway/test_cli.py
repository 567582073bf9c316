"""`looprl restart` with a name the stack does not run, or with no stack: a clear message, no traceback."""

from __future__ import annotations

from pathlib import Path

from gateway import cli
from gateway.stack import SERVICES, ServiceProcess, StackState


def _saved_stack(state_dir: Path) -> StackState:
    # pid 0 is never a service's: the command must refuse before it signals anything.
    services = [
        ServiceProcess(name, 0, 1, 2, str(state_dir / f"{name}.log"), module) for name, module in SERVICES
    ]
    state = StackState(str(state_dir), 1, 0, 2, 0, "ray-token", "gateway-token", 3, services)
    state.save()
    return state


def test_restart_of_an_unknown_service_lists_the_services_and_fails(tmp_path: Path, capsys) -> None:
    _saved_stack(tmp_path)
    assert cli.main(["--state-dir", str(tmp_path), "restart", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unknown service 'nope'; the stack runs: weight-sync, inference-router, ")
    assert all(name in err for name, _ in SERVICES)


def test_restart_without_a_stack_says_so(tmp_path: Path, capsys) -> None:
    assert cli.main(["--state-dir", str(tmp_path), "restart", "gateway"]) == 1
    assert "no local stack is up" in capsys.readouterr().err
