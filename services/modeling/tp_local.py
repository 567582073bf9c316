"""Tensor parallelism inside one process: every TP rank in its own thread, all-reduce by summation.

`LocalTPGroup` drives the ranks of a layout in lockstep, each an `EngineModel` holding only its
own shard, with `ThreadAllReduce` summing the row-parallel partials and the vocab-parallel
embeddings, and gathering the vocab-parallel logits. Tests use it to check TP
numerics without Ray or torch.distributed; an engine may use it to serve a tp>1 layout in one
process. Every rank gets the same inputs and computes the same logits; rank 0's are returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import Tensor

from services.modeling.config import ModelConfig
from services.modeling.engine_model import EngineModel, KVCache
from services.modeling.layouts import Layout, shard_state_dict

T = TypeVar("T")


class ThreadAllReduce:
    """Sum-all-reduce across `world_size` threads; call `callback(rank)` to get each rank's function."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[Tensor | None] = [None] * world_size

    def callback(self, rank: int) -> Callable[[Tensor], None]:
        def all_reduce(tensor: Tensor) -> None:
            self._slots[rank] = tensor.clone()
            self._barrier.wait()
            # Same summation order on every rank, so every rank ends with bit-identical values.
            total = self._slots[0].clone()  # type: ignore[union-attr]
            for other in self._slots[1:]:
                total += other  # type: ignore[operator]
            self._barrier.wait()  # nobody overwrites a slot before all have read
            tensor.copy_(total)

        return all_reduce

    def gather_callback(self, rank: int) -> Callable[[Tensor], Tensor]:
        """All-gather: every rank's tensor (same shapes) stacked in rank order, on every rank."""

        def all_gather(tensor: Tensor) -> Tensor:
            self._slots[rank] = tensor.clone()
            self._barrier.wait()
            out = torch.stack(self._slots)  # type: ignore[arg-type]
            self._barrier.wait()
            return out

        return all_gather

    def abort(self) -> None:
        """Release ranks waiting in an all-reduce (after another rank failed)."""
        self._barrier.abort()


class LocalTPGroup:
    """All ranks of `layout` as EngineModels in this process, each with its own KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        layout: Layout,
        max_slots: int,
        max_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        layout.check(config)
        self.config, self.layout = config, layout
        self.reducer = ThreadAllReduce(layout.tp_size)
        tp = layout.tp_size
        r = self.reducer
        self.models = [
            EngineModel(config, layout, i, r.callback(i), device, r.gather_callback(i))
            if tp > 1
            else EngineModel(config, layout, i, device=device)
            for i in range(tp)
        ]
        self.caches = [m.new_cache(max_slots, max_len) for m in self.models]
        self._pool = ThreadPoolExecutor(max_workers=tp, thread_name_prefix="tp-rank") if tp > 1 else None

    def _connect(self) -> None:
        """Point every rank's collectives at the current reducer."""
        if self.layout.tp_size > 1:
            for r, m in enumerate(self.models):
                m.all_reduce, m.all_gather = self.reducer.callback(r), self.reducer.gather_callback(r)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def load_shards(self, shards: Sequence[Mapping[str, Tensor]]) -> None:
        if len(shards) != self.layout.tp_size:
            raise ValueError(f"load_shards: need {self.layout.tp_size} shards, got {len(shards)}")
        for model, shard in zip(self.models, shards, strict=True):
            model.load_shard(shard)

    def load_full_state_dict(self, full_sd: Mapping[str, Tensor]) -> None:
        """Shard HF-named weights with the layout's plan and load each rank's part."""
        shards = [shard_state_dict(full_sd, self.config, self.layout, r) for r in range(self.layout.tp_size)]
        self.load_shards(shards)

    def run(self, fn: Callable[[EngineModel, KVCache], T]) -> list[T]:
        """fn(model, cache) on every rank at once; the first failure aborts the others and is raised."""
        if self._pool is None:
            return [fn(self.models[0], self.caches[0])]

        def on_rank(rank: int) -> Any:
            try:
                return fn(self.models[rank], self.caches[rank])
            except BaseException:
                self.reducer.abort()
                raise

        futures = [self._pool.submit(on_rank, r) for r in range(self.layout.tp_size)]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:
                errors.append(e)
        if errors:
            # A broken barrier is only the echo of another rank's failure; raise the cause.
            causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            self.reducer = ThreadAllReduce(self.layout.tp_size)
            self._connect()
            raise (causes or errors)[0]
        return results

    def allocate(self) -> int:
        slots = {cache.allocate() for cache in self.caches}
        assert len(slots) == 1, "rank caches diverged"
        return slots.pop()

    def free(self, slot: int) -> None:
        for cache in self.caches:
            cache.free(slot)

    def prefill(self, slot: int, token_ids: Tensor, start_pos: int = 0, all_logits: bool = False) -> Tensor:
        return self.run(lambda m, c: m.prefill(c, slot, token_ids, start_pos, all_logits))[0]

    def decode(self, slots: Tensor, token_ids: Tensor, positions: Tensor) -> Tensor:
        return self.run(lambda m, c: m.decode(c, slots, token_ids, positions))[0]
