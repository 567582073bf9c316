"""Escape attempts against the real sandbox: each is contained, reported, and leaves the host and
the pool working. Runs real worker processes in real namespaces (the suite runs as root)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from services.environment_sandbox.sandbox import ExecJob, SandboxConfig, SandboxPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops privileges: needs root")
# A uid range of its own, so pools of other processes on this host (services under test) never
# share uids with the pools checked here.
UID_BASE = 700000


@pytest.fixture
async def pool():
    p = await SandboxPool(
        SandboxConfig(warm_workers=2, timeout_s=2.0, max_output_bytes=256 * 1024, uid_base=UID_BASE)
    ).start()
    yield p
    # The pool still works after whatever the test did.
    after = await p.execute(ExecJob("print(6 * 7)"))
    assert after.exit_code == 0 and after.stdout.strip() == "42"
    await p.close()


async def test_isolation_is_fully_applied_as_root(pool):
    result = await pool.execute(ExecJob("import os; print(os.getuid(), os.getgid(), os.getgroups())"))
    assert result.exit_code == 0
    uid, gid, groups = result.stdout.split(" ", 2)
    assert UID_BASE <= int(uid) < UID_BASE + 64 * 256 and int(gid) == 65534 and groups.strip() == "[]"
    assert result.missing_isolation == []
    for mechanism in (
        "netns",
        "pidns",
        "mountns",
        "cgroupns",
        "rootfs",
        "cgroup",
        "seccomp",
        "rlimits",
        "no_new_privs",
    ):
        assert mechanism in result.isolation


async def test_reading_a_root_only_host_file_is_denied(pool, tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    secret.chmod(0o600)
    code = f"print(open({str(secret)!r}).read())"
    result = await pool.execute(ExecJob(code))
    assert result.exit_code != 0
    assert "top secret" not in result.stdout
    assert "PermissionError" in result.stderr or "FileNotFoundError" in result.stderr
    # /root holds nothing visible either (only the interpreter tree is bound back).
    listing = await pool.execute(ExecJob("import os; print(sorted(os.listdir('/root')))"))
    assert listing.stdout.strip() in ("['.pyenv']", "[]") or "PermissionError" in listing.stderr


async def test_writing_outside_the_workspace_is_denied(pool, tmp_path: Path):
    target = tmp_path / "owned.txt"
    code = (
        "import os\n"
        "results = []\n"
        f"for path in [{str(target)!r}, '/etc/owned', '/work/owned', '/usr/owned']:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); results.append('wrote ' + path)\n"
        "    except OSError as exc:\n"
        "        results.append(type(exc).__name__)\n"
        "open('/tmp/inside.txt', 'w').write('fine')\n"
        "print(results)\n"
    )
    result = await pool.execute(ExecJob(code))
    assert result.exit_code == 0, result.stderr
    assert "wrote" not in result.stdout
    assert not target.exists()
    for path in ("/etc/owned", "/work/owned", "/usr/owned"):
        assert not Path(path).exists()


async def test_network_connection_to_a_host_listener_fails(pool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(2.0)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    )
    result = await pool.execute(ExecJob(code))
    listener.close()
    thread.join(3)
    assert result.exit_code != 0
    assert "connected" not in result.stdout
    assert "unreachable" in result.stderr.lower() or "refused" in result.stderr.lower()
    assert not accepted


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_killed(pool):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = await pool.execute(ExecJob(code, timeout_s=1.5))
    assert result.timed_out and result.killed_reason == "timeout"
    # Nothing of the bomb survives on the host: no process is left under the bomb's uid.
    uid = int(next(m for m in result.isolation if m.startswith("uid:")).split(":")[1])
    for _ in range(40):
        leftovers = [
            p for p in Path("/proc").iterdir() if p.name.isdigit() and _uid_of(p) == uid and _alive(p)
        ]
        if not leftovers:
            break
        await asyncio.sleep(0.05)
    assert not leftovers


async def test_memory_bomb_hits_the_address_space_limit(pool):
    result = await pool.execute(
        ExecJob("blocks = []\nwhile True:\n    blocks.append(bytearray(50_000_000))\n", timeout_s=10.0)
    )
    assert result.exit_code != 0
    assert result.killed_reason == "memory"
    assert "MemoryError" in result.stderr


@pytest.mark.slow
async def test_infinite_loop_is_stopped_at_the_wall_clock_limit(pool):
    result = await pool.execute(ExecJob("while True:\n    pass\n", timeout_s=1.0))
    assert result.timed_out
    assert result.killed_reason == "timeout"
    assert 0.9 <= result.wall_seconds < 3.0


async def test_a_hundred_megabytes_of_output_is_capped(pool):
    code = "import sys\nchunk = 'x' * 1_000_000\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    result = await pool.execute(ExecJob(code))
    assert result.output_truncated
    assert result.killed_reason == "output"
    assert len(result.stdout) + len(result.stderr) <= 256 * 1024
    assert result.wall_seconds < 2.0


async def test_killing_the_parent_does_not_reach_the_host(pool):
    host_pid = os.getpid()
    code = (
        "import os, signal\n"
        "outcomes = []\n"
        f"for pid in (os.getppid(), {host_pid}, 1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL); outcomes.append('sent')\n"
        "    except OSError as exc:\n"
        "        outcomes.append(type(exc).__name__)\n"
        "print('still here', outcomes)\n"
    )
    result = await pool.execute(ExecJob(code))
    # The parent is the namespace init (pid 1): SIGKILL from inside is ignored by the kernel;
    # the host's pid is not visible from inside.
    assert result.exit_code == 0, result.stderr
    assert "still here" in result.stdout
    assert "ProcessLookupError" in result.stdout or "PermissionError" in result.stdout
    os.kill(host_pid, 0)  # we are alive


async def test_no_state_leaks_between_jobs(pool):
    first = await pool.execute(
        ExecJob("import builtins\nbuiltins.LEAK = 1\nopen('/tmp/left.txt','w').write('x')")
    )
    assert first.exit_code == 0
    second = await pool.execute(
        ExecJob("import builtins, os\nprint(hasattr(builtins, 'LEAK'), os.path.exists('/tmp/left.txt'))")
    )
    assert second.stdout.strip() == "False False"


async def test_files_stdin_and_exit_codes(pool):
    job = ExecJob(
        "import sys, helper\nprint(helper.double(int(sys.stdin.read())))\nsys.exit(3)",
        stdin="21",
        files={"helper.py": "def double(x):\n    return 2 * x\n"},
    )
    result = await pool.execute(job)
    assert result.stdout.strip() == "42"
    assert result.exit_code == 3


def _alive(proc_dir: Path) -> bool:
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _uid_of(proc_dir: Path) -> int:
    try:
        return proc_dir.stat().st_uid
    except OSError:
        return -1
