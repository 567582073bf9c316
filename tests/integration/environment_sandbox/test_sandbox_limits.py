"""Limits that hold for the sandbox as a whole, and a sandbox that fails closed.

Real workers, real cgroups, namespaces and seccomp (the suite runs as root). Each test measures
what a hostile program reached against the configured limit; the numbers are printed (-s)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from looprl.environment.v1 import environment_pb2, environment_pb2_grpc
from services.environment_sandbox.sandbox import ExecJob, SandboxConfig, SandboxPool
from services.environment_sandbox.sandbox.job import InvalidJob
from tests.support.service_process import service_process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops privileges: needs root")
UID_BASE = 720000
MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
async def pool():
    p = await SandboxPool(
        SandboxConfig(
            warm_workers=1,
            timeout_s=10.0,
            uid_base=UID_BASE,
            memory_bytes=256 * MiB,
            pids=24,
            nproc=256,  # well above pids: the cgroup, not RLIMIT_NPROC, is what must hold
            cpu_quota=0.5,
            workspace_bytes=8 * MiB,
        )
    ).start()
    yield p
    after = await p.execute(ExecJob("print(6 * 7)"))
    assert after.exit_code == 0 and after.stdout.strip() == "42", after.stderr
    await p.close()


async def test_forked_children_share_one_memory_limit(pool):
    # Four children of 100 MiB each: each is under the per-process address-space limit (256 MiB),
    # together they are over the sandbox's 256 MiB.
    code = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(100 * 1024 * 1024)\n"
        "        block[::4096] = b'x' * len(block[::4096])\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "codes = [os.waitpid(pid, 0)[1] for pid in kids]\n"
        "print(sum(1 for c in codes if os.WIFSIGNALED(c) and os.WTERMSIG(c) == 9))\n"
    )
    result = await pool.execute(ExecJob(code, timeout_s=30.0))
    assert result.exit_code == 0, (result.killed_reason, result.stderr)
    killed = int(result.stdout.strip())
    print(
        f"\nmemory: peak {result.memory_peak_bytes / MiB:.0f} MiB of a 256 MiB limit, {killed} of 4 children killed"
    )
    assert killed >= 1  # 400 MiB did not fit: the OOM killer ended some
    assert 0 < result.memory_peak_bytes <= 256 * MiB
    assert result.killed_reason == "memory"


async def test_process_count_is_limited_for_the_sandbox(pool):
    code = (
        "import os, time\n"
        "started = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
        "    started += 1\n"
        "print(started, flush=True)\n"
        "os.killpg(0, 9)\n"
    )
    result = await pool.execute(ExecJob(code))
    started = int(result.stdout.strip().splitlines()[0])
    print(f"\npids: {started} children started under pids.max = 24 (outer, init and runner count too)")
    assert 10 <= started <= 24 - 3


@pytest.mark.slow
async def test_cpu_quota_holds_across_processes(pool):
    # Four busy processes for 1.5 s of wall clock may use 0.5 CPU between them, not 2 (both cores).
    code = (
        "import os, time\n"
        "def spin():\n"
        "    end = time.monotonic() + 1.5\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "start = time.monotonic()\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        spin(); os._exit(0)\n"
        "    pids.append(pid)\n"
        "for pid in pids:\n"
        "    os.waitpid(pid, 0)\n"
        "t = os.times()\n"
        "print(t.children_user + t.children_system, time.monotonic() - start)\n"
    )
    result = await pool.execute(ExecJob(code))
    cpu, wall = map(float, result.stdout.split())
    throttled = result.cpu_throttled_seconds
    print(
        f"\ncpu: {cpu:.2f} CPU-s in {wall:.2f} s = {cpu / wall:.2f} CPUs, quota 0.5, throttled {throttled:.2f} s"
    )
    assert cpu / wall <= 0.5 * 1.25
    if cpu / wall >= 0.45:  # it reached its quota (on a host busy enough, it never gets there)
        assert throttled > 0  # and the quota, not the busy host, is what held it back


async def test_workspace_is_a_size_limited_tmpfs_off_the_host_disk(pool):
    code = (
        "import os, time\n"
        "written = 0\n"
        "chunk = b'x' * (1024 * 1024)\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'/tmp/f{i}', 'wb') as fh:\n"
        "            fh.write(chunk)\n"
        "        written += len(chunk)\n"
        "except OSError as exc:\n"
        "    print(written, exc.errno, flush=True)\n"
        "time.sleep(1.0)\n"
    )
    task = asyncio.ensure_future(pool.execute(ExecJob(code)))
    on_host = 0
    while not task.done():  # what reaches the host's disk under the pool's directory meanwhile
        on_host = max(on_host, sum(f.stat().st_size for f in pool._dir.rglob("*") if f.is_file()))
        await asyncio.sleep(0.05)
    result = task.result()
    written, err = map(int, result.stdout.split())
    print(
        f"\ndisk: {written / MiB:.0f} MiB written before ENOSPC under an 8 MiB workspace; {on_host} bytes on the host"
    )
    assert err == 28 and 6 * MiB <= written <= 8 * MiB
    assert on_host == 0


async def test_user_namespaces_mount_ptrace_bpf_and_keyctl_fail_inside(pool):
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def errno_of(rc):\n"
        "    return ctypes.get_errno() if rc == -1 else 0\n"
        "out = {}\n"
        "out['unshare_user'] = errno_of(libc.unshare(0x10000000))\n"
        "out['clone_user'] = errno_of(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))\n"
        "out['mount'] = errno_of(libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None))\n"
        "out['ptrace'] = errno_of(libc.ptrace(0, 0, 0, 0))\n"
        "out['bpf'] = errno_of(libc.syscall(321, 0, 0, 0))\n"
        "out['keyctl'] = errno_of(libc.syscall(250, 0, 0, 0, 0, 0))\n"
        "pid = os.fork()\n"  # plain fork still works
        "if pid == 0:\n"
        "    os._exit(7)\n"
        "out['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "import json; print(json.dumps(out))\n"
    )
    result = await pool.execute(ExecJob(code))
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert "seccomp" in result.isolation
    for call in ("unshare_user", "clone_user", "mount", "ptrace", "bpf", "keyctl"):
        assert out[call] == 1, (call, out)  # EPERM
    assert out["fork"] == 7


async def test_only_the_interpreter_and_system_libraries_are_visible(pool):
    code = (
        "import json, os, sys\n"
        f"checkout = {str(REPO)!r}\n"
        "print(json.dumps({'root': sorted(os.listdir('/')), 'checkout': os.path.exists(checkout),\n"
        "    'git': os.path.exists(checkout + '/.git'), 'work': os.path.exists('/work'),\n"
        "    'etc': os.path.exists('/etc/passwd'), 'sandbox_dirs': os.path.exists('/tmp/looprl-sandbox'),\n"
        "    'usr_writable': os.access('/usr', os.W_OK), 'exe': os.path.exists(sys.executable)}))\n"
    )
    result = await pool.execute(ExecJob(code))
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert not seen["checkout"] and not seen["git"] and not seen["work"]
    assert not seen["etc"] and not seen["sandbox_dirs"] and not seen["usr_writable"]
    assert seen["exe"]  # the interpreter itself is there, so subprocesses of it can run
    assert set(seen["root"]) <= {
        "usr",
        "bin",
        "lib",
        "lib64",
        "lib32",
        "libx32",
        "sbin",
        "tmp",
        "proc",
        "dev",
        "root",
        "opt",
    }


async def test_malformed_files_keys_are_refused_naming_the_key(pool):
    for key in ("sub/", "../x", "/etc/x", "", "a\0b", "a//b", "./a", "main.py"):
        with pytest.raises(InvalidJob, match=r"files\["):
            await pool.execute(ExecJob("print(1)", files={key: "x"}))
    with pytest.raises(InvalidJob, match=r"files\['a/b'\]: 'a' is also given as a file"):
        await pool.execute(ExecJob("print(1)", files={"a": "1", "a/b": "2"}))
    good = await pool.execute(ExecJob("print(open('sub/x.txt').read())", files={"sub/x.txt": "ok"}))
    assert good.stdout.strip() == "ok"


_CHILD = """
import asyncio, json, sys
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool, ExecJob
from services.environment_sandbox.sandbox.job import SandboxUnavailable

async def main():
    out = {}
    refused = SandboxPool(SandboxConfig(warm_workers=1, uid_base=730000))
    try:
        await refused.start()
        out["full"] = "started"
    except SandboxUnavailable as exc:
        out["full"] = str(exc)
    # The service answers FAILED_PRECONDITION, and says why in its status.
    from looprl.environment.v1 import environment_pb2 as pb
    from services.environment_sandbox.servicer import EnvironmentSandboxServicer
    from services.kit.rpc.errors import FailedPrecondition

    servicer = EnvironmentSandboxServicer(refused, None)
    try:
        await servicer.Exec(pb.ExecRequest(code="print(1)"), None)
        out["exec"] = "ran"
    except FailedPrecondition as exc:
        out["exec"] = "FAILED_PRECONDITION: " + str(exc)
    status = (await servicer.ListEnvironments(pb.ListEnvironmentsRequest(), None)).sandbox
    out["status"] = [status.isolation_level, status.unavailable]
    try:
        degraded = SandboxConfig(warm_workers=1, uid_base=730000, isolation_level="degraded", python=sys.argv[1])
        pool = await SandboxPool(degraded).start()
    except Exception as exc:
        out["degraded"] = str(exc)
    else:
        result = await pool.execute(ExecJob("print(6 * 7)"))
        out["degraded"] = [result.stdout.strip(), result.missing_isolation, pool.isolation_status()["level"]]
        await pool.close()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_without_cap_sys_admin_the_pool_refuses_unless_degraded_is_chosen(tmp_path: Path):
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("capsh (libcap2-bin) is not installed")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.run(
        [capsh, "--drop=cap_sys_admin", "--", "-c", f"exec {sys.executable} {script} {_degraded_python()}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["full"].startswith("sandbox isolation unavailable, refusing to run code")
    assert "netns: Operation not permitted" in out["full"] and "degraded" in out["full"]
    assert out["exec"].startswith("FAILED_PRECONDITION: sandbox isolation unavailable")
    assert out["status"] == ["full", out["full"]]
    # The service keeps serving environments that run no code, and refuses code, saying why.
    env = {"LOOPRL_ENV_CONSUME_EPISODES": "false", "LOOPRL_LOG_LEVEL": "ERROR"}

    def without_sys_admin(command: list[str]) -> list[str]:
        return [capsh, "--drop=cap_sys_admin", "--", "-c", "exec " + shlex.join(command)]

    with (
        service_process("services.environment_sandbox", env, timeout=120, wrap=without_sys_admin) as svc,
        grpc.insecure_channel(svc.address) as channel,
    ):
        stub = environment_pb2_grpc.EnvironmentSandboxServiceStub(channel)
        listed = stub.ListEnvironments(environment_pb2.ListEnvironmentsRequest(), timeout=30)
        assert "refusing to run code" in listed.sandbox.unavailable
        assert "LOOPRL_ENV_SANDBOX__ISOLATION_LEVEL" in listed.sandbox.unavailable
        with pytest.raises(grpc.RpcError) as refused:
            stub.Exec(environment_pb2.ExecRequest(code="print(1)"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Degraded: the code runs, and every response says what is missing.
    stdout, missing, level = out["degraded"]
    assert stdout == "42" and level == "degraded"
    assert any(m.startswith("netns") for m in missing)


def _degraded_python() -> str:
    """An interpreter the sandbox uid can reach without a private root (pyenv under /root is not)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        real = os.path.realpath(candidate)
        parts = Path(real).parts
        if os.path.exists(real) and all(
            os.stat(Path(*parts[:i])).st_mode & 0o001 for i in range(2, len(parts))
        ):
            return real
    pytest.skip("no interpreter outside private directories for the degraded run")
