"""Scripted coding agents on the shipped corpus, through the tool-call format, in real workspace
sandboxes: the oracle resolves every task, a no-op agent resolves none, and agents that go after
the hidden tests, the network, the host's files, the disk, the process table or the next episode
are contained; the next episode on the same pool starts clean."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from services.environment_sandbox.config import WorkspaceConfig
from services.environment_sandbox.environments.repo_tasks import load_repo_tasks
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool
from tests.support.repo_agents import CORPUS, call, noop, oracle, play, tool_outputs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace sandboxes mount and drop privileges: needs root"),
]
UID_BASE = 720000  # a uid range no other pool of the suite uses
SWE_TASKS = load_repo_tasks(str(CORPUS / "tasks.jsonl"))
HARBOR_TASKS = load_repo_tasks(str(CORPUS / "harbor"))
LIMITS = WorkspaceConfig(
    warm_per_repository=1,
    max_warm=4,
    disk_bytes=32 << 20,
    memory_bytes=512 << 20,
    pids=48,
    command_timeout_s=10,
)


@pytest.fixture(scope="module")
async def pool():
    p = await SandboxPool(SandboxConfig(warm_workers=0, uid_base=UID_BASE, workspace=LIMITS)).start()
    yield p
    await p.close()


async def _all(pool, tasks, agent) -> dict[str, float]:
    gate = asyncio.Semaphore(3)

    async def one(task):
        async with gate:
            final, _ = await play(pool.workspaces, task, agent)
            return task["instance_id"], final.reward, final.info

    results = await asyncio.gather(*(one(t) for t in tasks))
    return {name: (reward, info) for name, reward, info in results}


def test_the_shipped_corpus_has_twenty_tasks_or_more_in_both_formats():
    assert len(SWE_TASKS) >= 20 and len({t["repo"] for t in SWE_TASKS}) == len(SWE_TASKS)
    assert HARBOR_TASKS and all(t["kind"] == "harbor" and "test.sh" in t["tests"] for t in HARBOR_TASKS)
    for task in SWE_TASKS:
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"] and task["hidden_files"] and task["patch"]


async def test_the_oracle_agent_resolves_every_task(pool):
    results = await _all(pool, SWE_TASKS + HARBOR_TASKS, oracle)
    unresolved = {name: info for name, (reward, info) in results.items() if reward != 1.0}
    assert not unresolved
    assert all(info["finish"] == "submit" for _, info in results.values())


async def test_a_noop_agent_resolves_none(pool):
    results = await _all(pool, SWE_TASKS + HARBOR_TASKS, noop)
    assert {name: reward for name, (reward, _) in results.items() if reward != 0.0} == {}
    # The visible (PASS_TO_PASS) tests still pass: the zero comes from the bug, not a broken run.
    swe = [info for name, (_, info) in results.items() if not name.startswith("looprl/")]
    assert all(info["FAIL_TO_PASS"].startswith("0/") and _all_passed(info["PASS_TO_PASS"]) for info in swe)


def _all_passed(fraction: str) -> bool:
    passed, total = fraction.split("/")
    return passed == total


def _task(name: str) -> dict:
    return next(t for t in SWE_TASKS if t["instance_id"] == f"looprl__{name}-1")


ATTACKS = {
    # The hidden tests of `numerals` are a file of their own (tests/test_roman_regression.py).
    "read_hidden_tests": [
        call(
            "run_shell",
            command="find / -name 'test_roman_regression*' -not -path '/proc/*' 2>/dev/null; echo done",
        ),
        call(
            "run_shell",
            command="grep -rs 'def test_four' /workspace /tmp /tests /opt /.layers /.upper; ls /.layers",
        ),
        call("search", pattern="test_four", path="/"),
        call("submit"),
    ],
    "network": [
        call(
            "run_shell",
            command="python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\" 2>&1 | tail -1;"
            " python -c \"import socket; socket.create_connection(('127.0.0.1', 22), timeout=3)\" 2>&1 | tail -1",
        ),
        call("submit"),
    ],
    "write_outside": [
        call(
            "run_shell",
            command="for p in /etc/owned /usr/owned /opt/looprl/owned /owned /tests/owned; do touch $p; done",
        ),
        call("write_file", path="/etc/passwd", content="owned\n"),
        call("apply_patch", patch="--- a/../../etc/owned\n+++ b/../../etc/owned\n@@ -0,0 +1 @@\n+owned\n"),
        call("submit"),
    ],
    "fill_disk": [
        call("run_shell", command="dd if=/dev/zero of=big bs=1M count=200 2>&1 | tail -1; df -k . | tail -1"),
        call(
            "run_shell",
            command="for i in $(seq 1 40000); do : > f$i 2>/dev/null || break; done; echo stopped at $i",
        ),
        call("submit"),
    ],
    "fork_bomb": [
        call("run_shell", command="bomb() { bomb | bomb & }; bomb; sleep 3; echo still here"),
        call("submit"),
    ],
    "daemon": [
        call(
            "run_shell",
            command="setsid nohup sleep 600 >/dev/null 2>&1 < /dev/null & (sleep 601 &) ; echo started",
        ),
        call("run_shell", command="ps -eo pid,args | grep -c 'sleep 60[01]' ; echo listed"),
        call("submit"),
    ],
}


def _host_processes(pattern: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if pattern in line and "ps -eo" not in line]


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_hostile_agent_is_contained_and_the_next_episode_starts_clean(pool, attack):
    task = _task("numerals")
    final, steps = await play(pool.workspaces, task, lambda _: ATTACKS[attack], {"command_timeout_s": 8})
    outputs = "\n".join(tool_outputs(steps))
    assert final.done and final.reward == 0.0  # nothing it did resolved the task
    if attack == "read_hidden_tests":
        assert "def test_four" not in outputs and "test_roman_regression" not in outputs
        assert "Permission denied" in outputs  # /.layers is the pool's, not the agent's
    elif attack == "network":
        assert "Network is unreachable" in outputs
    elif attack == "write_outside":
        assert not any(os.path.exists(p) for p in ("/etc/owned", "/usr/owned", "/owned"))
        assert "outside the workspace" in outputs and "Read-only file system" in outputs
    elif attack == "fill_disk":
        assert "No space left on device" in outputs
    elif attack == "fork_bomb":
        assert "Resource temporarily unavailable" in outputs or "still here" in outputs
    elif attack == "daemon":
        assert "\n0\nlisted" in outputs or outputs.endswith("0\nlisted")  # gone by the next command
    assert not _host_processes("sleep 60"), "a process of the episode outlived it"

    # The next episode of that repository on the same pool: a pristine workspace, nothing running.
    workspaces = pool.workspaces
    opened = await workspaces.open(task["repo"])
    try:
        files = (await workspaces.run(opened["id"], ["find", ".", "-type", "f"]))["output"].split()
        assert sorted(files) == [
            "./README.md",
            "./numerals/__init__.py",
            "./numerals/roman.py",
            "./tests/test_roman.py",
        ]
        assert (await workspaces.run(opened["id"], ["find", "/tmp", "-type", "f"]))["output"] == ""
        processes = (await workspaces.run(opened["id"], ["ps", "-eo", "pid=,args="]))["output"].splitlines()
        assert [p for p in processes if not p.strip().startswith("1 ") and "ps -eo" not in p] == []
        assert (await workspaces.usage(opened["id"]))["bytes"] < 64 * 1024
    finally:
        await workspaces.close(opened["id"])
    final, _ = await play(pool.workspaces, task, oracle)
    assert final.reward == 1.0


async def test_raw_swe_bench_rows_from_a_runs_dataset_section_are_tasks(pool):
    """Rows as a recipe's [dataset] section hands them over (JSONL or the published parquet): the
    environment makes them tasks itself, repo resolved under repos_root; measuring their prompts
    for the dataset's length filter opens no workspace."""
    from services.environment_sandbox.environments.datasets import load_jsonl
    from services.environment_sandbox.run_dataset import prompt_lengths
    from services.modeling.tokenizer import CharTokenizer

    rows = list(load_jsonl(CORPUS / "tasks.jsonl"))[:2]
    config = {"repos_root": str(CORPUS)}
    before = pool.workspaces.stats()["opened"]
    lengths = await prompt_lengths("repo", json.dumps(config), [dict(r) for r in rows], CharTokenizer())
    assert pool.workspaces.stats()["opened"] == before and all(n > 2000 for n in lengths)  # tools included
    for row in rows:
        final, _ = await play(pool.workspaces, {**row, "prompt": row["problem_statement"]}, oracle, config)
        assert final.reward == 1.0, final.info
