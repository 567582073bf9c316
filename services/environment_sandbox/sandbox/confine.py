"""What the sandbox worker does to confine itself: a private root filesystem and a seccomp filter.

Standard library only (the worker runs with `python -I -S`). Both run in the worker's init, as
root inside its new mount and PID namespaces, before it drops privileges.

The root is an empty tmpfs into which only the interpreter's tree and the declared read-only
paths are bind-mounted (read-only), plus /proc of the sandbox's own PID namespace, a few device
nodes, and /tmp: a tmpfs of the workspace size, the only writable place. After pivot_root the
host's tree is detached, so nothing else on the host (the project checkout, its .git, other
sandboxes' workspaces) exists for the sandboxed code, and what it writes lives in memory that the
sandbox's cgroup is charged for, never on the host's disk.

The seccomp filter allows everything except the syscalls a snippet never needs and that widen
the kernel's attack surface or undo the namespaces: new namespaces (unshare, setns, clone with a
CLONE_NEW* flag), mounts, ptrace and cross-process memory access, bpf, keyrings, perf,
userfaultfd, io_uring, module loading, kexec, reboot, clock setting. They fail with EPERM.
clone3 fails with ENOSYS (its flags are in memory a filter cannot read), so libc uses clone.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

CLONE_NEW_FLAGS = (
    0x00020000,  # NEWNS
    0x02000000,  # NEWCGROUP
    0x04000000,  # NEWUTS
    0x08000000,  # NEWIPC
    0x10000000,  # NEWUSER
    0x20000000,  # NEWPID
    0x40000000,  # NEWNET
    0x00000080,  # NEWTIME
)
DENIED_SYSCALLS = [
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "uselib",
    "vhangup",
    "nfsservctl",
]
DEFAULT_VISIBLE = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def _bind_readonly(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(
    new_root: str,
    visible: list[str],
    workspace_bytes: int,
    uid: int,
    gid: int,
    before_pivot: Callable[[str], None] | None = None,
) -> None:
    """Make `new_root` (an empty directory) the root of this mount namespace, as described above.
    `before_pivot(new_root)` adds what a kind of sandbox needs beside that (workspace_init.py's
    mount points) while the host's tree is still reachable."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in visible:
        real = os.path.realpath(path)
        if not os.path.exists(real):
            continue
        target = new_root + path
        if os.path.islink(path) and os.path.dirname(path) == "/":
            # merged-/usr hosts: /bin -> usr/bin stays a link to the bound /usr
            os.symlink(os.readlink(path), target)
            continue
        if os.path.lexists(target):
            continue  # already inside an earlier bind (read-only there too)
        _bind_readonly(real, target)
    os.makedirs(new_root + "/tmp")
    mount(
        "tmpfs",
        new_root + "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={workspace_bytes},mode=0700,uid={uid},gid={gid},nr_inodes=4096",
    )
    os.makedirs(new_root + "/proc")
    mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    dev = new_root + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/2", f"{dev}/stderr")
    os.makedirs(dev + "/shm")
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=1m")
    if before_pivot is not None:
        before_pivot(new_root)
    old = new_root + "/.old-root"
    os.makedirs(old)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(_libc.syscall(number, new_root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount old root")
    os.rmdir("/.old-root")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=1m")


def private_proc_and_tmp(workspace: str) -> None:
    """The fallback without a private root: this PID namespace's /proc, the workspace as /tmp."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(workspace, "/tmp", None, MS_BIND)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def apply_seccomp(load: bool = True) -> int:
    """Install the filter on this thread (inherited by every child); the number of rules added.
    `load=False` builds the filter and drops it: a check that this host can apply it, for a process
    (a workspace sandbox's init) that must itself stay unfiltered."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise OSError(errno.ENOENT, f"libseccomp.so.2 not loadable ({exc})") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    rules = 0
    try:

        def add(name: str, action: int, cmp: _ArgCmp | None = None) -> None:
            nonlocal rules
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                return  # unknown to this libseccomp: also unknown to callers built against it
            rc = lib.seccomp_rule_add_array(
                ctx, action, number, 1 if cmp else 0, ctypes.byref(cmp) if cmp else None
            )
            if rc != 0:
                raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")
            rules += 1

        for name in DENIED_SYSCALLS:
            add(name, _errno_action(errno.EPERM))
        for flag in CLONE_NEW_FLAGS:
            add("clone", _errno_action(errno.EPERM), _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        add("clone3", _errno_action(errno.ENOSYS))
        rc = lib.seccomp_load(ctx) if load else 0
        if rc != 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)
    return rules
