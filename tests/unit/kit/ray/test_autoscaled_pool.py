"""The autoscaled actor pool (services/kit/ray/autoscaled_pool.py) over plain handles: it starts the
minimum, grows at once with the queue, shrinks one idle actor at a time after the quiet period,
routes to the least loaded (started) actor and retires everything on close."""

from __future__ import annotations

import asyncio

from services.kit.ray.autoscale import Autoscaler
from services.kit.ray.autoscaled_pool import AutoscaledPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(queue: list[int], clock: Clock, sizes: list[tuple[int, int]], retired: list[str]):
    names = iter(f"actor{i}" for i in range(100))

    async def retire(handle: str) -> None:
        retired.append(handle)

    return AutoscaledPool(
        Autoscaler(1, 3, target_queue_per_replica=2, down_after_s=10, clock=clock),
        lambda: next(names),
        retire,
        lambda: queue[0],
        interval_s=3600,  # decisions are driven by the test
        on_size=lambda size, peak: sizes.append((size, peak)),
    )


async def test_the_pool_grows_with_the_queue_and_shrinks_one_idle_actor_at_a_time():
    queue, clock, sizes, retired = [0], Clock(), [], []
    pool = make_pool(queue, clock, sizes, retired)
    pool.start()
    assert [m.handle for m in pool.members] == ["actor0"]
    queue[0] = 5  # 5 waiting at 2 per actor: 3 actors, at once
    await pool.scale()
    assert len(pool) == 3 and pool.peak == 3
    queue[0] = 0
    pool.members[2].in_flight = 1
    await pool.scale()
    assert len(pool) == 3  # wanted fewer only just now
    clock.now = 11
    await pool.scale()
    assert len(pool) == 2 and retired == ["actor1"]  # one at a time, an idle one
    clock.now = 22
    await pool.scale()
    assert [m.handle for m in pool.members] == ["actor2"] and retired == ["actor1", "actor0"]
    clock.now = 33
    await pool.scale()
    assert len(pool) == 1  # the minimum, however idle
    await pool.close()
    assert len(pool) == 0 and retired == ["actor1", "actor0", "actor2"]
    assert sizes[-1] == (0, 3) and max(size for size, _ in sizes) == 3


async def test_work_goes_to_the_least_loaded_started_actor():
    queue, clock, sizes, retired = [0], Clock(), [], []
    pool = make_pool(queue, clock, sizes, retired)
    a, b, c = pool.add(), pool.add(), pool.add()
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 0
    assert pool.least_loaded() is c
    assert pool.least_loaded(started_only=True) is None  # Ray has placed none yet
    a.started = b.started = True
    assert pool.least_loaded(started_only=True) is b
    pool.discard(b)
    pool.discard(b)  # already gone: nothing happens
    assert pool.least_loaded(started_only=True) is a and retired == []
    await pool.close()
    assert sorted(retired) == ["actor0", "actor2"]


async def test_the_scaling_loop_runs_until_close():
    queue, clock, sizes, retired = [4], Clock(), [], []
    pool = make_pool(queue, clock, sizes, retired)
    pool.interval_s = 0.01
    pool.start()
    for _ in range(200):
        if len(pool) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(pool) == 2
    await pool.close()
    assert len(pool) == 0 and len(retired) == 2
