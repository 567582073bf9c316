"""A real weight-sync service process on a free port, without the bus (for tests that register
targets and push versions by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.kit.local import free_port, stop_process_group, wait_for_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def weight_sync_process(log_dir: Path, **settings: str) -> Iterator[tuple[str, str]]:
    """(address, log path) of a running weight-sync; settings are LOOPRL_WEIGHTSYNC_<NAME> values."""
    port = free_port()
    env = {
        **os.environ,
        "LOOPRL_WEIGHTSYNC_GRPC_PORT": str(port),
        "LOOPRL_WEIGHTSYNC_USE_BUS": "false",
        "LOOPRL_WEIGHTSYNC_GRACE_SECONDS": "2",
        **{f"LOOPRL_WEIGHTSYNC_{name.upper()}": value for name, value in settings.items()},
    }
    log_path = log_dir / "weight-sync.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.weight_sync"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port(port, 90, proc, "weight-sync")
            yield f"127.0.0.1:{port}", str(log_path)
        finally:
            stop_process_group(proc, grace=10)
