"""The supervisor of a workspace sandbox: pid 1 of its namespaces, serving one episode's commands.

Standard library only (it runs inside worker.py's `python -I -S`). A workspace sandbox is a worker
whose init, instead of running one snippet, keeps a repository workspace for one episode:

    /workspace      overlayfs: lower layers (the repository's base, frozen forks, hidden tests)
                    from /.layers, the upper layer and overlay workdir on the tmpfs at /.upper, whose
                    size is the episode's disk limit (its pages are charged to the sandbox's cgroup)
    /.layers        the pool's layer directory (host, root-only 0700), bound in for mounting lowers
                    and for writing frozen copies of the upper layer
    /opt/looprl     the read-only Python runtime (interpreter, pytest, the workspace tools)
    /tests          a read-only layer bound only in scoring forks of Harbor-style tasks
    /tmp            the sandbox's scratch tmpfs (HOME); /logs points into it

The init stays root in its own mount namespace (it mounts and freezes layers) and never runs
untrusted code. Each command runs in a child that drops to the sandbox's uid, sets no_new_privs,
rlimits and the seccomp filter, and execs the command in /workspace with the runtime on PATH. When
the command exits (or its wall clock runs out), every other process in the PID namespace is killed:
a daemon or a fork bomb ends with the command that started it, and the next command, the next fork
and the next episode start without it. Ops arrive as JSON lines on the job pipe; each gets one
`reply <json>` status line:

    mount  {lowers, tests}         (re)mount /workspace over these layers with a fresh, empty upper
    run    {argv, stdin, env, cwd, timeout_s, max_output_bytes}
    freeze {layer, revert, agent_layers, base}   copy the upper layer into /.layers/<layer>
    usage  {}                      bytes and inodes used on /.upper
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import stat
import time

import confine

WORKSPACE = "/workspace"
UPPER_ROOT = "/.upper"
LAYERS = "/.layers"
TESTS = "/tests"
RUNTIME = "/opt/looprl"
UPPER, WORK = UPPER_ROOT + "/upper", UPPER_ROOT + "/work"
# Plain copy-up only: a metacopy or redirect xattr in an upper layer would refer to a lower file
# that a frozen copy of that layer no longer sits on.
OVERLAY_OPTIONS = "metacopy=off,redirect_dir=off,index=off"
OPAQUE = "trusted.overlay.opaque"
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


def mount_points(new_root: str, runtime_dir: str, layers_dir: str) -> None:
    """confine.build_root's `before_pivot` for a workspace sandbox: the mount points above."""
    confine._bind_readonly(runtime_dir, new_root + RUNTIME)
    os.makedirs(new_root + LAYERS, mode=0o700)
    confine.mount(layers_dir, new_root + LAYERS, None, confine.MS_BIND)
    confine.mount(
        None,
        new_root + LAYERS,
        None,
        confine.MS_REMOUNT | confine.MS_BIND | confine.MS_NOSUID | confine.MS_NODEV,
    )
    os.makedirs(new_root + UPPER_ROOT, mode=0o700)
    os.makedirs(new_root + WORKSPACE, mode=0o755)
    os.makedirs(new_root + TESTS, mode=0o755)
    os.symlink("/tmp/logs", new_root + "/logs")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _umount(path: str) -> None:
    if _libc.umount2(path.encode(), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")


class Supervisor:
    def __init__(self, args: dict, status_fd: int) -> None:
        self.args = args
        self.uid, self.gid = args["uid"], args["gid"]
        self.status_fd = status_fd
        spec = args["repository"]
        self.disk_bytes = int(spec["disk_bytes"])
        self.disk_inodes = int(spec["disk_inodes"])
        self.limits = dict(args["limits"])
        self.seccomp = "seccomp" in args["want"]
        self.mounted = self.tests_bound = self.upper_mounted = False
        self._exited: dict[int, int] = {}
        # SIGCHLD wakes the output loop the moment a command exits.
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        if self.seccomp:
            with contextlib.suppress(OSError):
                ctypes.CDLL("libseccomp.so.2")  # loaded once here, so each command's child maps it cheaply

    # -- ops ------------------------------------------------------------------------------------------

    def op_mount(self, req: dict) -> dict:
        lowers = [str(layer) for layer in req["lowers"]]
        if not lowers:
            raise ValueError("lowers: a workspace needs at least its base layer")
        self._kill_others()
        if self.tests_bound:
            _umount(TESTS)
            self.tests_bound = False
        if self.mounted:
            _umount(WORKSPACE)
            self.mounted = False
        if self.upper_mounted:  # a fresh tmpfs: empty upper, the whole disk budget again
            _umount(UPPER_ROOT)
            self.upper_mounted = False
        confine.mount(
            "tmpfs",
            UPPER_ROOT,
            "tmpfs",
            confine.MS_NOSUID | confine.MS_NODEV,
            f"size={self.disk_bytes},nr_inodes={self.disk_inodes},mode=0700",
        )
        self.upper_mounted = True
        os.mkdir(UPPER, 0o777)
        os.chmod(UPPER, 0o777)  # the workspace's root directory: writable by the command's uid
        os.mkdir(WORK, 0o700)
        lowerdir = ":".join(f"{LAYERS}/{layer}" for layer in lowers)
        confine.mount(
            "overlay",
            WORKSPACE,
            "overlay",
            confine.MS_NOSUID | confine.MS_NODEV,
            f"lowerdir={lowerdir},upperdir={UPPER},workdir={WORK},{OVERLAY_OPTIONS}",
        )
        self.mounted = True
        for path in ("/tmp/logs", "/tmp/logs/verifier"):  # where /logs points: Harbor's verifiers write there
            os.makedirs(path, mode=0o755, exist_ok=True)
            os.chown(path, self.uid, self.gid)
        if req.get("tests"):
            confine.mount(f"{LAYERS}/{req['tests']}", TESTS, None, confine.MS_BIND)
            confine.mount(
                None,
                TESTS,
                None,
                confine.MS_REMOUNT
                | confine.MS_BIND
                | confine.MS_RDONLY
                | confine.MS_NOSUID
                | confine.MS_NODEV,
            )
            self.tests_bound = True
        return {}

    def op_run(self, req: dict) -> dict:
        argv = [str(a) for a in req["argv"]]
        timeout = float(req["timeout_s"])
        cap = int(req["max_output_bytes"])
        env = {
            "PATH": f"{RUNTIME}/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **{str(k): str(v) for k, v in req.get("env", {}).items()},
        }
        out_r, out_w = os.pipe()
        stdin_fd = os.memfd_create("stdin")
        _write_all(stdin_fd, req.get("stdin", "").encode())
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self._exec_child(argv, env, req.get("cwd", WORKSPACE), out_w, stdin_fd, timeout)
        os.close(out_w)
        os.close(stdin_fd)
        kept = bytearray()
        truncated = timed_out = False
        status = None
        deadline = started + timeout
        open_fds = [out_r, self._wake_r]
        while True:
            if status is None:
                status = self._status_of(pid)
                if status is not None:
                    self._kill_others()  # its daemons: they would hold the output open too
            if status is not None and out_r not in open_fds:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 and status is None:
                timed_out = True
                self._kill_others()
                status = self._status_of(pid)
                continue
            ready, _, _ = select.select(open_fds, [], [], max(0.0, remaining) if status is None else 1.0)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            if out_r in ready:
                chunk = os.read(out_r, 1 << 16)
                if not chunk:
                    open_fds.remove(out_r)
                    continue
                take = max(0, min(len(chunk), cap - len(kept)))
                kept += chunk[:take]
                truncated = truncated or take < len(chunk)
            elif status is not None and not ready:
                break  # exited, everything killed, and still no EOF: nothing more is coming
        os.close(out_r)
        self._exited.clear()
        wall = time.monotonic() - started
        reply = {"output": kept.decode(errors="replace"), "truncated": truncated, "timed_out": timed_out}
        reply["wall_seconds"] = wall
        if status is None:  # reaped by nobody: it cannot have exited normally
            reply["exit_code"] = -signal.SIGKILL
        elif os.WIFSIGNALED(status):
            reply["exit_code"] = -os.WTERMSIG(status)
        else:
            reply["exit_code"] = os.WEXITSTATUS(status)
        return reply

    def op_freeze(self, req: dict) -> dict:
        """Copy the upper layer into a new layer: owned by root, readable and writable by every
        sandbox uid (a fork runs as another uid), whiteouts and opaque directories kept. `revert`
        names files (pytest's configuration) whose changes in any of the agent's layers are undone:
        the base layer's version is put back, or a whiteout where the base has none."""
        self._kill_others()
        dst = f"{LAYERS}/{req['layer']}"
        os.mkdir(dst, 0o755)
        revert = set(req.get("revert", ()))
        stats = {"files": 0, "bytes": 0}
        _copy_tree(UPPER, dst, revert, stats)
        if revert:
            found: set[str] = set()
            for layer in [UPPER, *(f"{LAYERS}/{name}" for name in req.get("agent_layers", ()))]:
                _find_named(layer, "", revert, found)
            base = f"{LAYERS}/{req['base']}"
            for rel in sorted(found):
                target = os.path.join(dst, rel)
                os.makedirs(os.path.dirname(target), mode=0o777, exist_ok=True)
                original = os.path.join(base, rel)
                if os.path.isfile(original) and not os.path.islink(original):
                    _copy_file(original, target, os.lstat(original).st_mode, stats)
                else:
                    os.mknod(target, stat.S_IFCHR, 0)  # a whiteout: the file was not in the base
        return stats

    def op_usage(self, req: dict) -> dict:
        found = os.statvfs(UPPER_ROOT)
        return {
            "bytes": (found.f_blocks - found.f_bfree) * found.f_frsize,
            "inodes": found.f_files - found.f_ffree,
        }

    # -- the command's process ------------------------------------------------------------------------

    def _exec_child(self, argv: list[str], env: dict, cwd: str, out_w: int, stdin_fd: int, timeout: float):
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            os.dup2(stdin_fd, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            os.closerange(3, 1 << 20)
            os.setgroups([])
            os.setresgid(self.gid, self.gid, self.gid)
            os.setresuid(self.uid, self.uid, self.uid)
            _libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
            _libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0)
            _set_limits({**self.limits, "cpu_seconds": int(timeout) + 1})
            if self.seccomp:
                confine.apply_seccomp()
            os.umask(0o022)
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.write(2, f"sandbox: cannot run {argv[0]!r}: {exc}\n".encode())
        os._exit(127)

    def _reap(self) -> None:
        """Collect every exited child (orphans are re-parented to this init), keeping their statuses."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._exited[pid] = status

    def _status_of(self, pid: int) -> int | None:
        self._reap()
        return self._exited.pop(pid, None)

    def _kill_others(self) -> None:
        """SIGKILL every process of this PID namespace but the init, until none is left."""
        for _ in range(1000):
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit() and name != "1"]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self._reap()
            time.sleep(0.0005)

    # -- the op loop ----------------------------------------------------------------------------------

    def serve(self, job_fd: int) -> None:
        buffer = b""
        while True:
            chunk = os.read(job_fd, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    reply = getattr(self, "op_" + request["op"])(request)
                    reply["ok"] = True
                except Exception as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                _write_all(self.status_fd, b"reply " + json.dumps(reply).encode() + b"\n")
        self._kill_others()


def _set_limits(limits: dict) -> None:
    import resource

    table = {
        "cpu_seconds": resource.RLIMIT_CPU,
        "memory_bytes": resource.RLIMIT_AS,
        "nproc": resource.RLIMIT_NPROC,
        "fsize_bytes": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
    }
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, which in table.items():
        value = int(limits.get(key, 0))
        if value > 0:
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))


def _copy_file(src: str, dst: str, mode: int, stats: dict) -> None:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            while chunk := os.read(fd, 1 << 20):
                _write_all(out, chunk)
                stats["bytes"] += len(chunk)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    os.chmod(dst, (mode & 0o111) | 0o666)  # no set-id bits; any sandbox uid may edit it
    stats["files"] += 1


def _copy_tree(src: str, dst: str, revert: set[str], stats: dict) -> None:
    """Copy a directory of an upper layer (no process runs in the sandbox meanwhile: nothing moves)."""
    with contextlib.suppress(OSError):
        os.setxattr(dst, OPAQUE, os.getxattr(src, OPAQUE, follow_symlinks=False))
    with os.scandir(src) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            target = os.path.join(dst, entry.name)
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(target, 0o777)
                os.chmod(target, 0o777)
                _copy_tree(entry.path, target, revert, stats)
            elif entry.name in revert:
                continue
            elif stat.S_ISLNK(info.st_mode):
                os.symlink(os.readlink(entry.path), target)
            elif stat.S_ISREG(info.st_mode):
                _copy_file(entry.path, target, info.st_mode, stats)
            elif stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                os.mknod(target, stat.S_IFCHR, 0)  # a whiteout: deleted in this layer
            # fifos, sockets and devices are not workspace state


def _find_named(root: str, rel: str, names: set[str], found: set[str]) -> None:
    """Paths (relative to the layer) of entries named in `names`, deleted ones (whiteouts) included."""
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, rel) if rel else root) as entries:
        for entry in entries:
            path = os.path.join(rel, entry.name) if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                _find_named(root, path, names, found)
            elif entry.name in names:
                found.add(path)
