"""One cgroup per sandbox (memory, pids, CPU quota) on whichever hierarchy the host offers.

Per-process rlimits bound one process; a sandbox that forks gets a multiple of them. A cgroup
bounds the sandbox as a whole: every process the worker starts is in it, so memory, processes and
CPU time are counted together. cgroup v2 (one unified hierarchy) is used when the host has it
with the three controllers; otherwise the v1 memory, pids and cpu hierarchies, each mounted on its
own. A pool's cgroups live under the cgroup this process is in (so limits set above it, e.g. by a
container runtime, still apply), in `looprl-sandbox-<pid>`, one child per worker.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

POOL_PREFIX = "looprl-sandbox-"
CPU_PERIOD_US = 100_000


class CgroupUnavailable(RuntimeError):
    """The host offers no writable memory+pids+cpu cgroup hierarchy (the message says why)."""


def _own_paths() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _mounts() -> dict[str, str]:
    """Controller (or "" for the v2 hierarchy) -> mount point, from /proc/self/mountinfo."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup2":
            found.setdefault("", fields[4])
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("memory", "pids", "cpu"):
                    found.setdefault(option, fields[4])
    return found


@dataclass
class SandboxCgroup:
    """The cgroup(s) of one worker: the worker joins them before it starts anything."""

    version: int
    dirs: dict[str, Path]  # controller -> directory ("" for v2)
    procs_files: list[str] = field(default_factory=list)

    def _file(self, controller: str, name: str) -> Path:
        return self.dirs["" if self.version == 2 else controller] / name

    def set_memory(self, limit: int) -> None:
        if self.version == 2:
            self._file("memory", "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                self._file("memory", "memory.swap.max").write_text("0")
            return
        memsw = self._file("memory", "memory.memsw.limit_in_bytes")
        # memsw (memory + swap) must stay >= the memory limit: order the writes so it always is.
        current = int(self._file("memory", "memory.limit_in_bytes").read_text())
        if memsw.exists() and limit > current:
            memsw.write_text(str(limit))
        self._file("memory", "memory.limit_in_bytes").write_text(str(limit))
        if memsw.exists():
            memsw.write_text(str(limit))

    def peak_memory(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(self._file("memory", name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in self._file("memory", name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def cpu_throttled_s(self) -> float:
        """Time the CPU quota held the sandbox back (cpu.stat)."""
        key, scale = ("throttled_usec", 1e-6) if self.version == 2 else ("throttled_time", 1e-9)
        try:
            for line in self._file("cpu", "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value) * scale
        except (OSError, ValueError):
            pass
        return 0.0

    def cpu_usage_s(self) -> float:
        """CPU time the sandbox's processes used in all (cgroup v2's cpu.stat; 0 on v1, whose cpu
        hierarchy does not account it)."""
        if self.version != 2:
            return 0.0
        try:
            for line in self._file("cpu", "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value) * 1e-6
        except (OSError, ValueError):
            pass
        return 0.0

    def remove(self, wait_s: float = 2.0) -> None:
        """Delete the directories once the processes are gone (a killed init takes a moment)."""
        deadline = time.monotonic() + wait_s
        for path in self.dirs.values():
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)


class CgroupHost:
    """Where this pool's cgroups live; `create` makes one per worker with the limits set."""

    def __init__(self, version: int, pool_dirs: dict[str, Path]) -> None:
        self.version = version
        self.pool_dirs = pool_dirs

    @property
    def name(self) -> str:
        return f"cgroup-v{self.version}"

    @classmethod
    def open(cls) -> CgroupHost:
        mounts, own = _mounts(), _own_paths()
        pool_name = f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        v2 = mounts.get("")
        if v2 and Path(v2, "cgroup.controllers").exists():
            available = set(Path(v2, "cgroup.controllers").read_text().split())
            if {"memory", "pids", "cpu"} <= available:
                return cls._open_v2(Path(v2) / own.get("", "/").lstrip("/"), pool_name)
        missing = [c for c in ("memory", "pids", "cpu") if c not in mounts]
        if missing:
            raise CgroupUnavailable(
                f"no cgroup v2 with memory+pids+cpu and no v1 {'/'.join(missing)} hierarchy"
            )
        dirs = {}
        try:
            for controller in ("memory", "pids", "cpu"):
                base = Path(mounts[controller]) / own.get(controller, "/").lstrip("/")
                _sweep_dead_pools(base)
                dirs[controller] = base / pool_name
                dirs[controller].mkdir()
        except OSError as exc:
            for made in dirs.values():
                with contextlib.suppress(OSError):
                    made.rmdir()
            raise CgroupUnavailable(f"cannot create cgroups: {exc}") from None
        return cls(1, dirs)

    @classmethod
    def _open_v2(cls, base: Path, pool_name: str) -> CgroupHost:
        _sweep_dead_pools(base)
        pool = base / pool_name
        try:
            pool.mkdir()
            # Controllers must be enabled on each level for the workers' cgroups to have them.
            for level in (base, pool):
                (level / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        except OSError as exc:
            with contextlib.suppress(OSError):
                pool.rmdir()
            raise CgroupUnavailable(f"cannot delegate cgroup v2 controllers under {base}: {exc}") from None
        return cls(2, {"": pool})

    def create(self, memory_bytes: int, pids: int, cpu_quota: float) -> SandboxCgroup:
        name = f"w-{uuid.uuid4().hex[:10]}"
        dirs = {key: base / name for key, base in self.pool_dirs.items()}
        group = SandboxCgroup(self.version, dirs)
        try:
            for path in dirs.values():
                path.mkdir()
            group.set_memory(memory_bytes)
            quota = max(1000, int(cpu_quota * CPU_PERIOD_US)) if cpu_quota > 0 else -1
            if self.version == 2:
                (dirs[""] / "pids.max").write_text(str(pids))
                (dirs[""] / "cpu.max").write_text(f"{quota if quota > 0 else 'max'} {CPU_PERIOD_US}")
                group.procs_files = [str(dirs[""] / "cgroup.procs")]
            else:
                (dirs["pids"] / "pids.max").write_text(str(pids))
                (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
                group.procs_files = [str(path / "cgroup.procs") for path in dirs.values()]
        except OSError:
            group.remove(0)
            raise
        return group

    def close(self) -> None:
        for path in self.pool_dirs.values():
            with contextlib.suppress(OSError):
                path.rmdir()


def _sweep_dead_pools(base: Path) -> None:
    """Remove the cgroups of pools whose process died without closing."""
    if not base.is_dir():
        return
    for entry in base.glob(POOL_PREFIX + "*"):
        try:
            pid = int(entry.name[len(POOL_PREFIX) :].split("-")[0])
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        for child in entry.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            entry.rmdir()
