"""Tensor parallelism across Ray actors: one process per TP rank, gloo for the collectives.

Rank 0 lives in the replica process and runs the scheduler (engine/scheduler.py) and sampling.
Ranks 1..tp-1 are `TPWorker` Ray actors. Every rank holds ONLY its own shard of the weights
(`services.modeling.layouts.rank_params`: fused qkv/gate_up column-parallel, o/down row-parallel)
in an `EngineModel` whose all_reduce is a gloo all-reduce over the group, so the row-parallel
partial sums (and the vocab-parallel embedding lookups) are added across processes exactly as vLLM
does across GPUs; the vocab-parallel logits are joined by a gloo all-gather.

Each step rank 0 broadcasts a fixed-size header [op, a, b] and then the step's int64 payload
(slots, lengths/positions, token ids); every worker thread sits in a loop receiving these and
runs the same forward. Only rank 0's logits are used.

Weights: every rank stages its own shard in its own `WeightStager` (buckets for rank r are
forwarded to worker r, as received: no re-encoding). A commit first checks that every rank holds
the version complete, then the swap runs between two steps: rank 0 broadcasts LOAD(version) and
every rank commits its stager and loads its shard; an all-reduce of "loaded" flags confirms the
group switched together. Each rank hands its retired shard back to its stager as the rollback
point, so a rejected canary version is undone the same way: after checking that every rank still
holds the version before, rank 0 broadcasts ROLLBACK(version) and every rank swaps it back in.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from services.inference_router.engine.cpu import to_rank_shard
from services.inference_router.engine.scheduler import ContinuousBatchingEngine, SchedulerLimits, StepExecutor
from services.modeling.config import ModelConfig
from services.modeling.engine_model import EngineModel
from services.modeling.layouts import Layout, rank_params
from services.weights.stager import WeightStager
from services.weights.wire import decode_stage_request

log = logging.getLogger(__name__)

OP_PREFILL, OP_DECODE, OP_LOAD, OP_STOP, OP_ROLLBACK = 1, 2, 3, 4, 5
# Workers block in a broadcast while the engine is idle; rank 0's death kills them (Ray fate
# sharing), so a long timeout only bounds a genuinely stuck collective.
_GROUP_TIMEOUT = datetime.timedelta(hours=12)


def make_group(host: str, port: int, rank: int, world: int, name: str) -> dist.ProcessGroupGloo:
    """A standalone gloo group (no global default group, so several engines can share a process)."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, _GROUP_TIMEOUT)


def gloo_all_reduce(group: dist.ProcessGroup):
    def all_reduce(tensor: torch.Tensor) -> None:
        group.allreduce([tensor]).wait()

    return all_reduce


def gloo_all_gather(group: dist.ProcessGroup):
    """The vocab-parallel logits of every rank, stacked in rank order (equal shapes on every rank)."""

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(group.size())]
        group.allgather([out], [tensor.contiguous()]).wait()
        return torch.stack(out)

    return all_gather


class _Rank:
    """What every rank does with one step message (shared by rank 0 and the workers)."""

    def __init__(self, config: ModelConfig, layout: Layout, rank: int, group, num_slots: int, max_len: int):
        self.group = group
        self.model = EngineModel(
            config, layout, rank, all_reduce=gloo_all_reduce(group), all_gather=gloo_all_gather(group)
        )
        self.cache = self.model.new_cache(num_slots, max_len)
        self.stager = WeightStager(rank_params(config, layout, rank))

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        return self.model.prefill_prompts(self.cache, slots, prompts)

    def decode(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode(self.cache, slots, tokens, positions)

    def load(self, version: int) -> bool:
        try:
            state = self.stager.commit(version)
            old = self.model.params
            self.model.load_shard(state)
            self.stager.give_back({k: v for k, v in old.items() if k in self.stager.specs})
            ok = True
        except Exception:
            log.exception("rank %d failed to load version %d", self.model.rank, version)
            ok = False
        return self._agree(ok)

    def rollback(self, version: int) -> bool:
        """Undo the commit of `version`: serve the retired shard again (checked by `can_rollback`
        on every rank first, so a rank fails here only on a broken process)."""
        try:
            _, state = self.stager.rollback(version)
            old = self.model.params
            self.model.load_shard(state)
            self.stager.recycle({k: v for k, v in old.items() if k in self.stager.specs})
            ok = True
        except Exception:
            log.exception("rank %d failed to roll back version %d", self.model.rank, version)
            ok = False
        return self._agree(ok)

    def can_rollback(self, version: int) -> int | None:
        """The version a rollback of `version` returns to, or None when this rank cannot."""
        s = self.stager
        return s.rollback_version if s.serving_version == version else None

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        self.group.allreduce([flag]).wait()
        return int(flag) == self.group.size()


class TPExecutor(StepExecutor):
    """Rank 0's StepExecutor: broadcast the step, compute the local shard, return the logits."""

    def __init__(self, rank0: _Rank, num_slots: int, max_model_len: int):
        self.r = rank0
        self.vocab_size = rank0.model.config.vocab_size
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self._closed = False

    def _send(self, op: int, a: int = 0, b: int = 0, payload: torch.Tensor | None = None) -> None:
        self.r.group.broadcast(torch.tensor([op, a, b], dtype=torch.int64), 0).wait()
        if payload is not None:
            self.r.group.broadcast(payload, 0).wait()

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        flat = [t for p in prompts for t in p]
        payload = torch.tensor(slots + [len(p) for p in prompts] + flat, dtype=torch.int64)
        self._send(OP_PREFILL, len(slots), len(flat), payload)
        return self.r.prefill(slots, prompts)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        payload = torch.tensor(slots + tokens + positions, dtype=torch.int64)
        self._send(OP_DECODE, len(slots), 0, payload)
        b = len(slots)
        return self.r.decode(payload[:b], payload[b : 2 * b], payload[2 * b :])

    def load_staged(self, version: int) -> None:
        self._send(OP_LOAD, version)
        if not self.r.load(version):
            raise RuntimeError(f"version {version}: not every TP rank could load it")

    def rollback_staged(self, version: int) -> None:
        self._send(OP_ROLLBACK, version)
        if not self.r.rollback(version):
            raise RuntimeError(f"version {version}: not every TP rank could roll it back")

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError("TP weights go through the stagers (TPEngine.load_weights)")

    @property
    def loaded(self) -> bool:
        return self.r.model.loaded

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._send(OP_STOP)
            except Exception:
                pass


class TPWorker:
    """TP rank >= 1 (a Ray actor: `ray.remote(TPWorker)`): holds its shard and follows rank 0's steps in a
    background thread. Ray is imported lazily so importing this module never touches Ray's auth setup."""

    def __init__(
        self,
        config: dict,
        layout: dict,
        rank: int,
        host: str,
        port: int,
        group_name: str,
        num_slots: int,
        max_len: int,
    ) -> None:
        torch.set_num_threads(1)
        cfg, lay = ModelConfig.from_dict(config), Layout.from_dict(layout)
        group = make_group(host, port, rank, lay.tp_size, group_name)
        self.rank = _Rank(cfg, lay, rank, group, num_slots, max_len)
        self.error: str = ""
        self._thread = threading.Thread(target=self._follow, name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        header = torch.zeros(3, dtype=torch.int64)
        r = self.rank
        try:
            while True:
                r.group.broadcast(header, 0).wait()
                op, a, b = (int(x) for x in header)
                if op == OP_STOP:
                    return
                if op == OP_LOAD:
                    r.load(a)
                    continue
                if op == OP_ROLLBACK:
                    r.rollback(a)
                    continue
                size = 2 * a + b if op == OP_PREFILL else 3 * a
                payload = torch.zeros(size, dtype=torch.int64)
                r.group.broadcast(payload, 0).wait()
                if op == OP_PREFILL:
                    slots, lengths, flat = (
                        payload[:a].tolist(),
                        payload[a : 2 * a].tolist(),
                        payload[2 * a :].tolist(),
                    )
                    prompts, off = [], 0
                    for n in lengths:
                        prompts.append(flat[off : off + n])
                        off += n
                    r.prefill(slots, prompts)
                else:
                    r.decode(payload[:a], payload[a : 2 * a], payload[2 * a :])
        except Exception as exc:  # rank 0 went away or a collective failed
            self.error = repr(exc)
            log.exception("TP worker loop stopped")

    def ping(self) -> str:
        return self.error

    def stage(self, request_bytes: bytes) -> dict[str, Any]:
        return dataclasses.asdict(self.rank.stager.stage(decode_stage_request(request_bytes)))

    def stage_state(self, version: int, shard: dict[str, torch.Tensor]) -> bool:
        for name, t in shard.items():
            self.rank.stager.stage_tensor(version, name, 0, t.contiguous())
        return self.rank.stager.is_complete(version)

    def is_complete(self, version: int) -> bool:
        return self.rank.stager.is_complete(version)

    def abort(self, version: int) -> bool:
        return self.rank.stager.abort(version)

    def can_rollback(self, version: int) -> int | None:
        return self.rank.can_rollback(version)


class TPEngine(ContinuousBatchingEngine):
    """A continuous-batching engine whose model is a TP group: rank 0 here, ranks 1.. as TPWorkers."""

    def __init__(
        self,
        executor: TPExecutor,
        workers: list,
        layout: Layout,
        config: ModelConfig,
        limits: SchedulerLimits | None = None,
    ):
        super().__init__(executor, -1, limits)
        self.workers = workers
        self.layout = layout
        self.config = config
        self.rank0 = executor.r

    @classmethod
    async def create(
        cls,
        config: ModelConfig,
        layout: Layout,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        limits: SchedulerLimits | None = None,
        worker_options: dict[str, Any] | None = None,
    ) -> TPEngine:
        """Spawn tp-1 workers and join them in a gloo group (needs a connected Ray)."""
        import asyncio
        import uuid

        import ray

        from services.kit.local.infra import free_port

        layout.check(config)
        if layout.tp_size < 2:
            raise ValueError("TPEngine needs tp_size >= 2 (use CPUEngine for tp=1)")
        max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        port, name = free_port(), f"tp-{uuid.uuid4().hex[:8]}"
        from services.kit.config.recipe import TP_WORKER_CPUS

        opts = {"num_cpus": TP_WORKER_CPUS, **(worker_options or {})}
        workers = [
            ray.remote(TPWorker)
            .options(**opts)
            .remote(config.to_dict(), layout.to_dict(), r, host, port, name, max_batch_size, max_len)
            for r in range(1, layout.tp_size)
        ]
        group = await asyncio.to_thread(make_group, host, port, 0, layout.tp_size, name)
        await asyncio.gather(*(w.ping.remote() for w in workers))
        rank0 = _Rank(config, layout, 0, group, max_batch_size, max_len)
        return cls(TPExecutor(rank0, max_batch_size, max_len), workers, layout, config, limits)

    # ---- weights: every rank stages its shard, then one LOAD switches the group between steps
    async def stage(self, rank: int, request_bytes: bytes) -> dict[str, Any]:
        """Stage a bucket of rank 1.. on its worker (rank 0 stages in the replica, weights.py)."""
        return await self.workers[rank - 1].stage.remote(request_bytes)

    async def all_complete(self, version: int) -> bool:
        import asyncio

        remote = await asyncio.gather(*(w.is_complete.remote(version) for w in self.workers))
        return self.rank0.stager.is_complete(version) and all(remote)

    async def commit(self, version: int) -> None:
        from services.kit.rpc.errors import FailedPrecondition

        if not await self.all_complete(version):
            raise FailedPrecondition(f"version: {version} is not staged completely on every TP rank")
        executor = self.executor
        assert isinstance(executor, TPExecutor)
        await self.swap(version, lambda: executor.load_staged(version))

    async def rollback_weights(self, version: int) -> int:
        """Undo the commit of `version` on every rank (a rejected canary); returns the version served
        again. Every rank must still hold the same version before it, or nothing changes."""
        import asyncio

        from services.kit.rpc.errors import FailedPrecondition

        remote = await asyncio.gather(*(w.can_rollback.remote(version) for w in self.workers))
        targets = {self.rank0.can_rollback(version), *remote}
        if len(targets) != 1 or None in targets:
            raise FailedPrecondition(
                f"version: cannot roll back {version}: the TP ranks do not all serve it with the same version "
                f"held before it (rank 0: {self.rank0.can_rollback(version)}, others: {remote})"
            )
        (previous,) = targets
        executor = self.executor
        assert isinstance(executor, TPExecutor)
        await self.swap(previous, lambda: executor.rollback_staged(version), backwards=True)
        return previous

    async def rollback(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError("a TP group rolls back from its stagers (TPEngine.rollback_weights)")

    async def abort_staged(self, version: int) -> None:
        import asyncio

        self.rank0.stager.abort(version)
        await asyncio.gather(*(w.abort.remote(version) for w in self.workers))

    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Full HF state dict (or nothing else): shard per rank, stage everywhere, switch together."""
        import asyncio

        shards = [to_rank_shard(state_dict, self.config, self.layout, r) for r in range(self.layout.tp_size)]
        for name, t in shards[0].items():
            self.rank0.stager.stage_tensor(version, name, 0, t.contiguous())
        await asyncio.gather(
            *(w.stage_state.remote(version, shards[r + 1]) for r, w in enumerate(self.workers))
        )
        await self.commit(version)

    async def close(self) -> None:
        import ray

        await super().close()
        for w in self.workers:
            ray.kill(w)
