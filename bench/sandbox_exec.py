"""Sandbox execution: warm pool vs a cold `python` subprocess per execution.

Both run the same small test program. The warm path is the full sandbox (namespaces, dropped
privileges, rlimits, private workspace) with a pre-started worker; the baseline is a plain
`python -c` subprocess with no isolation at all, so the ratio is conservative.
Latency is measured with a warm worker available (the pool refills between calls); throughput is
measured under sustained load, where replacing used workers is part of the cost.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from bench.common import emit, parse_args, percentile
from services.environment_sandbox.sandbox import ExecJob, SandboxConfig, SandboxPool

PROGRAM = "import math\nprint(sum(math.isqrt(i) for i in range(2000)))\n"


def cold_once() -> float:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    assert out.stdout.strip()
    return time.perf_counter() - start


async def main() -> None:
    args = parse_args(__doc__)
    n = 20 if args.quick else 100
    pool = await SandboxPool(SandboxConfig(warm_workers=4, max_concurrency=4)).start()
    try:
        for _ in range(3):
            cold_once()
            await pool.execute(ExecJob(PROGRAM))
        warm, cold = [], []
        for _ in range(n):
            await pool.wait_warm()
            start = time.perf_counter()
            result = await pool.execute(ExecJob(PROGRAM))
            warm.append(time.perf_counter() - start)
            assert result.exit_code == 0 and result.warm, result
            cold.append(await asyncio.to_thread(cold_once))

        await pool.wait_warm()
        start = time.perf_counter()
        results = await asyncio.gather(*(pool.execute(ExecJob(PROGRAM)) for _ in range(n)))
        pool_rate = n / (time.perf_counter() - start)
        assert all(r.exit_code == 0 for r in results)

        def cold_batch() -> float:
            from concurrent.futures import ThreadPoolExecutor

            start = time.perf_counter()
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda _: cold_once(), range(n)))
            return n / (time.perf_counter() - start)

        cold_rate = await asyncio.to_thread(cold_batch)
    finally:
        await pool.close()

    w50, w99, c50, c99 = (
        percentile(warm, 50),
        percentile(warm, 99),
        percentile(cold, 50),
        percentile(cold, 99),
    )
    print(f"{'path':<28}{'p50 ms':>10}{'p99 ms':>10}{'execs/s':>10}")
    print(f"{'sandbox warm pool':<28}{w50 * 1e3:>10.2f}{w99 * 1e3:>10.2f}{pool_rate:>10.1f}")
    print(f"{'cold python subprocess':<28}{c50 * 1e3:>10.2f}{c99 * 1e3:>10.2f}{cold_rate:>10.1f}")
    emit("sandbox_exec", "warm_over_cold_p50", w50, c50, w50 / c50, "s", "<= 0.333")
    emit(
        "sandbox_exec",
        "execs_per_s",
        pool_rate,
        cold_rate,
        pool_rate / cold_rate,
        "execs/s",
        "higher is better",
    )


if __name__ == "__main__":
    asyncio.run(main())
