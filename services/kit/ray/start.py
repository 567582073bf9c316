"""`ray start` for the local stack's head, without the two processes the stack never talks to.

`python -m services.kit.ray.start start --head ...` takes `ray start`'s arguments and runs Ray's own
command, except that it starts neither Ray's client server (`ray://`, a Python process listening on
port 10001) nor the dashboard's API server (job submission and the state API). Services reach the
head as Ray drivers, never through either. Ray 2.60 has no flag for them: `--include-dashboard=false`
still starts a minimal API server, and the client server starts whenever grpcio is importable,
always on port 10001, so two stacks on one machine contend for it. Both are Python processes that
cost ~1.6 CPU-s while the stack comes up, when every service imports at once on 2 cores: without
them `looprl up` was SERVING in 7.7-9.1 s instead of 9.5-11.3 s (idle afterwards, they use ~3.5 ms
of CPU a second).

Both are switched off through the names Ray's own code consults, each a state Ray supports: the
client server is left out as when `ray[client]`'s dependencies are missing, and the API server as
when it fails to start with the dashboard off (`Node.start_api_server` records no process).
tests/unit/kit/ray/test_ray_start.py fails when a Ray upgrade moves either name.
"""

from __future__ import annotations

import sys

# (module, attribute) this launcher replaces; the unit test checks that the pinned Ray has them.
CLIENT_SERVER_CHECK = ("ray.scripts.scripts", "get_ray_client_dependency_error")
API_SERVER_START = ("ray._private.node", "Node.start_api_server")


def without_client_or_api_server() -> None:
    """Make this process's `ray start` skip Ray's client server and the dashboard's API server."""
    import ray._private.node as node
    import ray.scripts.scripts as scripts

    scripts.get_ray_client_dependency_error = lambda: ImportError("left out by services.kit.ray.start")
    node.Node.start_api_server = lambda self, **_: None


def main() -> int:
    without_client_or_api_server()
    from ray.scripts.scripts import main as ray_main

    sys.argv[0] = "ray"
    return ray_main()


if __name__ == "__main__":
    sys.exit(main())
