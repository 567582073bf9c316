"""The sandbox worker process: isolates itself, waits warm, runs exactly one job, exits.

Started by the pool as root with `python -I -S worker.py ...` (no site-packages, no PYTHON* env,
standalone: this file imports only the standard library). Process tree, as seen from the host:

    outer (root, host PID namespace)  -- joins the sandbox's cgroup, reports the init's host pid
      init  (pid 1 of a new PID namespace; new net/mount/IPC/UTS/cgroup namespaces; private root
             filesystem; then unprivileged, no_new_privs, seccomp filter: see confine.py)
        runner (pid 2): blocks on the job pipe, runs the untrusted code in-process, exits

The cgroup is joined first, so everything the worker ever starts counts against the sandbox's
memory, pids and CPU limits together.

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
import sys

# -I leaves the script's directory off sys.path: add it for confine.py alone, then take it off
# again so the sandboxed code cannot import the pool's modules.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import confine
import workspace_init

sys.path.pop(0)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
REAL_EXECUTABLE = os.path.realpath(sys.executable)  # before the venv's link to it is out of view

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


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _write_status(fd: int, kind: str, payload: object) -> None:
    os.write(fd, f"{kind} {json.dumps(payload)}\n".encode())


def _visible_paths(declared: list[str]) -> list[str]:
    """System library directories, this interpreter's own tree, and the declared read-only paths."""
    interpreter = {os.path.realpath(p) for p in (sys.base_prefix, os.path.dirname(os.__file__))}
    return list(confine.DEFAULT_VISIBLE) + sorted(interpreter) + list(declared)


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


def _run_job(job_fd: int, status_fd: int, home: str) -> None:
    """Runner: wait for the job, then run it in this (already warm) interpreter, in `home`."""
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
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "TMPDIR": home})
    main_path = os.path.join(home, "main.py")
    try:
        for rel, content in job.get("files", {}).items():
            path = os.path.join(home, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(content)
        with open(main_path, "w") as fh:
            fh.write(job["code"])
    except OSError as exc:  # e.g. the workspace is full: the program cannot start
        os.write(2, f"sandbox: could not write the job's files: {exc}\n".encode())
        os._exit(1)
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job.get("stdin", "").encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    _set_limits(job.get("limits", {}))
    sys.argv = ["main.py"]
    sys.path.insert(0, home)
    sys.executable = REAL_EXECUTABLE
    code = 0
    namespace = {"__name__": "__main__", "__file__": main_path, "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], main_path, "exec"), namespace)
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
    home = args["workspace"]
    repository = args.get("repository")  # a workspace sandbox (workspace_init.py) rather than one job
    if repository and not {"mountns", "rootfs"} <= set(args["want"]):
        raise OSError("a workspace sandbox needs the mount namespace and the private root")
    if "mountns" in args["want"]:
        if "rootfs" in args["want"]:
            try:
                visible = _visible_paths(args["readonly_paths"])
                extra = None
                if repository:
                    extra = lambda root: workspace_init.mount_points(  # noqa: E731
                        root, repository["runtime_dir"], repository["layers_dir"]
                    )
                confine.build_root(
                    args["workspace"], visible, args["workspace_bytes"], args["uid"], args["gid"], extra
                )
                applied.append("rootfs")
                home = "/tmp"
            except OSError as exc:
                if repository:
                    raise
                missing.append(f"rootfs: {exc}")
        if home != "/tmp":
            try:  # without the private root: at least this namespace's /proc and a private /tmp
                confine.private_proc_and_tmp(args["workspace"])
                home = "/tmp"
            except OSError as exc:
                missing.append(f"mountns: {exc}")
        applied.append("mountns")
    os.chdir(home)
    try:
        _libc.sethostname(b"sandbox", 7)
    except OSError:
        pass
    if repository:
        _serve_workspace(args, job_fd, status_fd, applied, missing)
    _drop_privileges(args["uid"], args["gid"])
    applied.append(f"uid:{args['uid']}")
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the credential change above
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    applied.append("no_new_privs")
    _set_limits(args["limits"])
    applied.append("rlimits")
    if "seccomp" in args["want"]:
        try:
            confine.apply_seccomp()
            applied.append("seccomp")
        except OSError as exc:
            missing.append(f"seccomp: {exc}")
    for name in PREIMPORT:
        __import__(name)
    runner = os.fork()
    if runner == 0:
        _run_job(job_fd, status_fd, home)
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


def _serve_workspace(args: dict, job_fd: int, status_fd: int, applied: list[str], missing: list[str]) -> None:
    """The init stays root (it mounts and freezes layers) and serves the episode's ops; every command
    drops privileges in its own child (workspace_init.py). The isolation each command gets is
    reported before the first op, in the same `ready` line code workers send."""
    applied += [f"uid:{args['uid']}", "no_new_privs", "rlimits"]
    if "seccomp" in args["want"]:
        try:
            confine.apply_seccomp(load=False)
            applied.append("seccomp")
        except OSError as exc:
            missing.append(f"seccomp: {exc}")
    supervisor = workspace_init.Supervisor(args, status_fd)
    supervisor.seccomp = "seccomp" in applied
    try:
        supervisor.op_mount({"lowers": args["repository"]["lowers"]})
    except OSError as exc:
        _write_status(status_fd, "error", {"error": f"workspace mount: {exc}", "missing": missing})
        os._exit(70)
    _write_status(status_fd, "ready", {"isolation": applied, "missing": missing})
    supervisor.serve(job_fd)
    os._exit(0)


def main() -> None:
    args = json.loads(sys.argv[1])
    job_fd, status_fd = args["job_fd"], args["status_fd"]
    applied: list[str] = []
    missing: list[str] = []
    if args.get("cgroup_procs"):
        try:
            for procs in args["cgroup_procs"]:
                with open(procs, "w") as fh:
                    fh.write(str(os.getpid()))
            applied.append(args["cgroup_name"])
        except OSError as exc:
            missing.append(f"cgroup: {exc}")
    flags = {
        "netns": CLONE_NEWNET,
        "pidns": CLONE_NEWPID,
        "mountns": CLONE_NEWNS,
        "ipcns": CLONE_NEWIPC,
        "utsns": CLONE_NEWUTS,
        "cgroupns": CLONE_NEWCGROUP,  # after joining the cgroup: its root is the sandbox's cgroup
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
                if "rootfs" in args["want"]:
                    missing.append("rootfs: needs the mount namespace")
                args["want"] = [w for w in args["want"] if w not in ("mountns", "rootfs")]
    child = os.fork()
    if child == 0:
        try:
            _init(args, job_fd, status_fd, applied, missing)
        except BaseException as exc:
            _write_status(status_fd, "error", {"error": f"{type(exc).__name__}: {exc}", "missing": missing})
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
