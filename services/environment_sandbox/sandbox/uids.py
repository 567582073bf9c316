"""Blocks of sandbox uids claimed per pool, and clean-up after pools that died."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.environment_sandbox.sandbox.job import SandboxError


class UidBlock:
    """A block of uids this pool owns exclusively on the host.

    RLIMIT_NPROC counts per uid across the whole host, so two pools (a service, a Ray actor, a
    test) handing out the same uid would share one process budget. A pool claims block k by
    creating `uid-block-k` exclusively (O_EXCL) with its pid inside; blocks of dead pids are
    taken over."""

    def __init__(self, root: Path, base: int, count: int, max_blocks: int = 64) -> None:
        for k in range(max_blocks):
            marker = root / f"uid-block-{k}"
            if self._claim(marker):
                self.marker = marker
                self.uids = list(range(base + k * count, base + (k + 1) * count))
                return
        raise SandboxError(f"all {max_blocks} sandbox uid blocks are in use on this host")

    @staticmethod
    def _claim(marker: Path) -> bool:
        for _ in range(2):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                try:
                    owner = int(marker.read_text() or "0")
                    if owner == os.getpid():
                        return False
                    os.kill(owner, 0)
                    return False
                except ProcessLookupError:
                    marker.unlink(missing_ok=True)  # the owner died: take the block over
                    continue
                except (ValueError, OSError):
                    return False
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
        return False

    def release(self) -> None:
        self.marker.unlink(missing_ok=True)


def sweep_dead_pools(root: Path) -> None:
    """Delete workspaces left by pools whose process died without closing (SIGKILL, OOM)."""
    for entry in root.glob("pool-*-*"):
        try:
            pid = int(entry.name.split("-")[1])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass
