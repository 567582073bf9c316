"""services/kit/ray/start.py against the pinned Ray: the names it replaces exist and are the ones
`ray start` consults, and replacing them leaves both servers out. The head it starts is checked in
tests/integration/kit/test_local_infra.py."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

from services.kit.ray import start as ray_start


def resolve(module: str, path: str):
    target = importlib.import_module(module)
    for name in path.split("."):
        target = getattr(target, name)
    return target


def test_the_replaced_names_exist_and_ray_start_consults_them() -> None:
    import ray._private.node as node
    import ray.scripts.scripts as scripts

    for module, path in (ray_start.CLIENT_SERVER_CHECK, ray_start.API_SERVER_START):
        assert callable(resolve(module, path)), f"{module}.{path} is gone from the pinned Ray"
    # The client server starts only when this check passes; the head's processes start the API server.
    assert "has_ray_client = get_ray_client_dependency_error() is None" in inspect.getsource(
        scripts.start.callback
    )
    assert "self.start_api_server(" in inspect.getsource(node.Node.start_head_processes)


def test_replacing_them_leaves_both_servers_out() -> None:
    # In a child: the replacement is for a `ray start` process, never for the test process.
    code = (
        "from services.kit.ray import start as ray_start\n"
        "ray_start.without_client_or_api_server()\n"
        "import ray.scripts.scripts as scripts, ray._private.node as node\n"
        "print(scripts.get_ray_client_dependency_error() is not None,"
        " node.Node.start_api_server(None, include_dashboard=False, raise_on_failure=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None"]
