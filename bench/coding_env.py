"""Coding-agent workspaces: setup from a warm pool vs a full copy, fork time, episodes per second.

- Setup: an episode's workspace from the repository's warm pool (a sandbox already started with the
  repository's base layer mounted; `open` hands it over with a fresh upper layer) against a full
  copy of the repository into a fresh directory (what a per-episode checkout or container volume
  pays). The repository is synthetic and mid-sized (2,000 files, 16 MB, like a small Python
  project with tests and docs); the shipped corpus's 4-file repositories are shown beside it.
  Both are measured with the page cache warm, one at a time, the pool refilled between samples.
- Fork: a live workspace with 20 edited files forked into a new one (its upper layer frozen, a warm
  sandbox mounting a new upper over it), against the same full copy.
- Throughput: the oracle agent (apply the fix, submit, hidden tests run in a scoring fork) on the
  shipped corpus with N episodes at once (1, 2, 4 and the core count; the figure is at the core
  count); episodes per second and the CPU each episode used, from
  the sandboxes' own accounting (every sandbox process is reaped, so its time is in this process's
  children's rusage) plus this process's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import emit, parse_args, percentile
from services.environment_sandbox.config import WorkspaceConfig
from services.environment_sandbox.environments import EnvContext, make_environment
from services.environment_sandbox.environments.repo_tasks import load_repo_tasks
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "configs" / "data" / "repo_corpus"
UID_BASE = 740000


def synthetic_repository(root: Path, files: int = 2000, size: int = 8192) -> Path:
    """`files` Python modules of `size` bytes in 40 packages: deterministic, offline."""
    line = "def function_{i}(value):\n    return value * {i} + len(str(value))\n\n"
    for n in range(files):
        package = root / f"pkg{n % 40:02d}"
        package.mkdir(parents=True, exist_ok=True)
        body, i = [], 0
        while sum(map(len, body)) < size:
            body.append(line.format(i=n * 1000 + i))
            i += 1
        (package / f"module_{n:04d}.py").write_text("".join(body)[:size])
    return root


def copy_once(repo: Path, scratch: Path) -> float:
    target = scratch / f"copy-{time.perf_counter_ns()}"
    start = time.perf_counter()
    shutil.copytree(repo, target, symlinks=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(target)
    return seconds


async def warm_once(pool: SandboxPool, repo: Path) -> float:
    workspaces = pool.workspaces
    await workspaces.wait_warm(str(repo))  # the sample is a warm start: the pool refilled first
    opened = await workspaces.open(str(repo))
    assert opened["warm"], "the pool had no warm sandbox for the repository"
    await workspaces.close(opened["id"])
    return opened["setup_seconds"]


async def fork_once(pool: SandboxPool, workspace: str, repo: Path) -> float:
    workspaces = pool.workspaces
    await workspaces.wait_warm(str(repo))
    forked = await workspaces.fork(workspace)
    await workspaces.close(forked["id"])
    return forked["fork_seconds"]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def oracle_episode(pool: SandboxPool, task: dict) -> float:
    env = make_environment("repo", {"max_turns": 4}, EnvContext(workspaces=pool.workspaces))
    try:
        await env.reset(task)
        await env.step(call("apply_patch", patch=task["patch"]))
        result = await env.step(call("submit"))
    finally:
        await env.close()
    assert result.done and result.reward == 1.0, result.info
    return result.reward


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def throughput(
    pool: SandboxPool, tasks: list[dict], concurrency: int, episodes: int
) -> tuple[float, float]:
    """(episodes per second, CPU seconds per episode) with `concurrency` episodes at once."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: dict) -> None:
        async with gate:
            await oracle_episode(pool, task)

    await asyncio.gather(*(one(tasks[i % len(tasks)]) for i in range(concurrency)))  # warm every repository
    await asyncio.sleep(0.5)  # warm sandboxes refilled, disposed sandboxes reaped
    cpu, start = cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(one(tasks[i % len(tasks)]) for i in range(episodes)))
    wall = time.perf_counter() - start
    await asyncio.sleep(0.5)  # the last sandboxes reaped: their CPU time is counted
    return episodes / wall, (cpu_seconds() - cpu) / episodes


async def main() -> None:
    args = parse_args(__doc__)
    samples = 15 if args.quick else 60
    episodes = 8 if args.quick else 32
    tasks = load_repo_tasks(str(CORPUS / "tasks.jsonl"))
    config = SandboxConfig(
        warm_workers=0,
        uid_base=UID_BASE,
        workspace=WorkspaceConfig(warm_per_repository=2, max_warm=48, disk_bytes=64 << 20),
    )
    with tempfile.TemporaryDirectory(prefix="looprl-bench-coding-") as scratch_dir:
        scratch = Path(scratch_dir)
        big = synthetic_repository(scratch / "repo")
        small = Path(tasks[0]["repo"])
        pool = await SandboxPool(config).start()
        try:
            results = {}
            for label, repo in (("mid-sized", big), ("corpus", small)):
                await pool.workspaces.prewarm(str(repo))
                for _ in range(3):  # warm-up: page cache, runtime, first sandboxes
                    copy_once(repo, scratch)
                    await warm_once(pool, repo)
                warm = [await warm_once(pool, repo) for _ in range(samples)]
                copy = [copy_once(repo, scratch) for _ in range(samples)]
                results[label] = (warm, copy)

            live = (await pool.workspaces.open(str(big)))["id"]
            await pool.workspaces.run(
                live,
                [
                    "bash",
                    "-c",
                    "for i in $(seq 0 19); do echo '# edited' >> pkg00/module_$(printf %04d $((i*40))).py; done",
                ],
            )
            for _ in range(3):
                await fork_once(pool, live, big)
            forks = [await fork_once(pool, live, big) for _ in range(samples)]
            await pool.workspaces.close(live)

            rates = {
                n: await throughput(pool, tasks, n, episodes) for n in sorted({1, 2, 4, os.cpu_count() or 1})
            }
        finally:
            await pool.close()

    print(f"{'workspace setup':<34}{'p50 ms':>10}{'p99 ms':>10}")
    for label, (warm, copy) in results.items():
        print(
            f"{'warm pool, ' + label:<34}{percentile(warm, 50) * 1e3:>10.3f}{percentile(warm, 99) * 1e3:>10.3f}"
        )
        print(
            f"{'full copy, ' + label:<34}{percentile(copy, 50) * 1e3:>10.3f}{percentile(copy, 99) * 1e3:>10.3f}"
        )
    print(
        f"{'fork (20 files changed)':<34}{percentile(forks, 50) * 1e3:>10.3f}{percentile(forks, 99) * 1e3:>10.3f}"
    )
    print(f"\n{'concurrent episodes':<22}{'episodes/s':>12}{'CPU s/episode':>15}{'CPU share each':>16}")
    for n, (rate, cpu) in rates.items():
        print(f"{n:<22}{rate:>12.2f}{cpu:>15.3f}{cpu * rate / n:>16.2f}")

    warm, copy = results["mid-sized"]
    for q in (50, 99):
        w, c = percentile(warm, q), percentile(copy, q)
        emit("coding_env", "setup_speedup_over_copy" + ("" if q == 50 else "_p99"), w, c, c / w, "s", ">= 10")
    warm, copy = results["corpus"]
    w, c = percentile(warm, 50), percentile(copy, 50)
    emit("coding_env", "setup_speedup_over_copy_small_repo", w, c, c / w, "s", "higher is better")
    f50, c50 = percentile(forks, 50), percentile(results["mid-sized"][1], 50)
    emit("coding_env", "fork_p50_ms", f50 * 1e3, c50 * 1e3, f50 / c50, "ms", "< 20", checks="value")
    # The headline is as many episodes at once as this machine has cores; the table shows the rest.
    cores = min(max(rates), max(1, os.cpu_count() or 1))
    (one, _), (many, cpu_many) = rates[1], rates[cores]
    emit(
        "coding_env",
        f"episodes_per_s_{cores}_concurrent",
        many,
        one,
        many / one,
        "episodes/s",
        "higher is better",
    )
    emit(
        "coding_env",
        f"cpu_share_per_episode_{cores}_concurrent",
        cpu_many * many / cores,
        None,
        None,
        "cores",
        "report",
    )


if __name__ == "__main__":
    asyncio.run(main())
