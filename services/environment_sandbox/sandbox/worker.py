"""The sandbox worker process: isolates itself, waits warm, runs exactly one job, exits.

Started by the pool as root with `python -I -S worker.py ...` (no site-packages, no PYTHON* env,
standalone: this file imports only the standard library). Process tree, as seen from the host:

    outer (root, host PID namespace)  -- reports the init's host pid and exits after it
      init  (pid 1 of a new PID namespace; new net/mount/IPC/UTS namespaces; then unprivileged)
        runner (pid 2): blocks on the job pipe, runs the untrusted code in-process, exits

The init is pid 1 of its namespace so that when it dies the kernel kills every process left in
the namespace (fork bombs, daemonised children, setsid escapes): the host needs one SIGKILL to
the init to end everything. The untrusted code runs in a child of the init, not in the init
itself, because a namespace init ignores signals it has no handler for (RLIMIT_CPU's SIGXCPU,
the code's own os.kill) which would change the code's behaviour.

Status lines go to the status pipe (never reachable by the untrusted code, which runs after the
runner closed it): `pid <host pid of init>`, `ready <json>`, `exit <json>`.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 16384
MS_BIND = 4096
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

# Modules untrusted code commonly imports, loaded before the job so it does not pay for them.
PREIMPORT = (
    "math",
    "re",
    "json",
    "random",
    "string",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "typing",
    "dataclasses",
    "fractions",
    "decimal",
    "statistics",
    "traceback",
    "io",
    "operator",
    "copy",
)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _write_status(fd: int, kind: str, payload: object) -> None:
    os.write(fd, f"{kind} {json.dumps(payload)}\n".encode())


def _hidden_prefix_dirs() -> list[tuple[str, str]]:
    """(top ancestor not traversable by others, interpreter dir below it) pairs.

    The interpreter may live under a directory the sandbox user cannot enter (pyenv under /root
    is 0700). Inside the private mount namespace such an ancestor is covered with an empty tmpfs
    and only the interpreter's own tree is bound back, so the sandbox can import the standard
    library without seeing anything else that was there."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.__file__))}
    pairs = []
    for path in sorted(needed):
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not (os.stat(ancestor).st_mode & stat.S_IXOTH):
                pairs.append((ancestor, path))
                break
    return pairs


def _setup_mounts(workspace: str, applied: list[str], missing: list[str]) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        applied.append("proc")
    except OSError as exc:
        missing.append(f"proc: {exc}")
    # Rebind the interpreter's tree under an empty tmpfs covering its private ancestor.
    for ancestor, keep in _hidden_prefix_dirs():
        fd = os.open(keep, os.O_PATH | os.O_DIRECTORY)
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        os.makedirs(keep, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", keep, None, MS_BIND | MS_REC, None)
        os.close(fd)
        applied.append(f"hide:{ancestor}")
    # World-writable places become private: the workspace is /tmp, the others are empty tmpfs.
    _mount(workspace, "/tmp", None, MS_BIND, None)
    for place in ("/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(place):
            _mount("tmpfs", place, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=1m")
    applied.append("mountns")


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _set_limits(limits: dict[str, int]) -> None:
    table = {
        "cpu_seconds": resource.RLIMIT_CPU,
        "memory_bytes": resource.RLIMIT_AS,
        "nproc": resource.RLIMIT_NPROC,
        "fsize_bytes": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
    }
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, which in table.items():
        if key in limits and limits[key] > 0:
            value = int(limits[key])
            # CPU gets a one-second gap between soft (SIGXCPU) and hard (SIGKILL).
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))


def _run_job(job_fd: int, status_fd: int) -> None:
    """Runner: wait for the job, then run it in this (already warm) interpreter."""
    chunks = []
    while True:
        chunk = os.read(job_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(job_fd)
    os.close(status_fd)
    if not chunks:
        os._exit(0)  # the pool closed without giving a job
    job = json.loads(b"".join(chunks))
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"})
    for rel, content in job.get("files", {}).items():
        path = os.path.join("/tmp", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(content)
    with open("/tmp/main.py", "w") as fh:
        fh.write(job["code"])
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job.get("stdin", "").encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    _set_limits(job.get("limits", {}))
    sys.argv = ["main.py"]
    sys.path.insert(0, "/tmp")
    code = 0
    namespace = {"__name__": "__main__", "__file__": "/tmp/main.py", "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], "/tmp/main.py", "exec"), namespace)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        import traceback

        # Drop this runner's own frame so the traceback starts in the user's code.
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _init(args: dict, job_fd: int, status_fd: int, applied: list[str], missing: list[str]) -> None:
    """pid 1 of the new PID namespace: finish isolation, fork the runner, report its exit."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if "mountns" in args["want"]:
        try:
            _setup_mounts(args["workspace"], applied, missing)
        except OSError as exc:
            missing.append(f"mountns: {exc}")
    if "mountns" not in applied:
        os.chdir(args["workspace"])
    else:
        os.chdir("/tmp")
    try:
        _libc.sethostname(b"sandbox", 7)
    except OSError:
        pass
    _drop_privileges(args["uid"], args["gid"])
    applied.append(f"uid:{args['uid']}")
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the credential change above
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    applied.append("no_new_privs")
    _set_limits(args["limits"])
    applied.append("rlimits")
    for name in PREIMPORT:
        __import__(name)
    runner = os.fork()
    if runner == 0:
        _run_job(job_fd, status_fd)
    os.close(job_fd)
    _write_status(status_fd, "ready", {"isolation": applied, "missing": missing})
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == runner:
            break
    if os.WIFSIGNALED(status):
        _write_status(status_fd, "exit", {"signal": os.WTERMSIG(status)})
    else:
        _write_status(status_fd, "exit", {"code": os.WEXITSTATUS(status)})
    os._exit(0)


def main() -> None:
    args = json.loads(sys.argv[1])
    job_fd, status_fd = args["job_fd"], args["status_fd"]
    applied: list[str] = []
    missing: list[str] = []
    flags = {
        "netns": CLONE_NEWNET,
        "pidns": CLONE_NEWPID,
        "mountns": CLONE_NEWNS,
        "ipcns": CLONE_NEWIPC,
        "utsns": CLONE_NEWUTS,
    }
    for name, flag in flags.items():
        if name not in args["want"]:
            continue
        if _libc.unshare(flag) == 0:
            if name != "mountns":  # recorded once the mounts are in place
                applied.append(name)
        else:
            missing.append(f"{name}: {os.strerror(ctypes.get_errno())}")
            if name == "mountns":
                args["want"] = [w for w in args["want"] if w != "mountns"]
    child = os.fork()
    if child == 0:
        try:
            _init(args, job_fd, status_fd, applied, missing)
        except BaseException as exc:
            _write_status(status_fd, "error", {"error": f"{type(exc).__name__}: {exc}"})
            os._exit(70)
    os.close(job_fd)
    _write_status(status_fd, "pid", {"pid": child})
    os.close(status_fd)
    while True:
        try:
            os.waitpid(child, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    os._exit(0)


if __name__ == "__main__":
    main()
