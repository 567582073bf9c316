"""A replica's weight lifecycle: stage a version rank by rank, commit it once every rank holds it
complete and verified, roll a rejected version back, abort a staging.

`WeightLifecycle` is the one interface the replica calls, over the three ways an engine holds weights:

- `LocalWeights`: a tp=1 CPU engine. One stager in the replica's process; the engine serves the
  state dict the stager handed over, and that state dict is the rollback point at the next commit.
- `TPGroupWeights`: a TP group (`TPEngine`). Rank 0 stages here, ranks 1.. on their TPWorker actors;
  the group switches versions together between two decode steps.
- `RankStagedWeights`: vLLM. Every TP rank's rectangles are staged in the replica's process and
  handed to vLLM's workers in one swap of all ranks.

The replica builds the lifecycle together with its engine (`ReplicaCore._ensure_engine`), so nothing
probes an engine for what it can do.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from looprl.inference.v1 import inference_pb2
from services.kit.rpc import errors
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.weights.stager import WeightStager

if TYPE_CHECKING:
    from services.inference_router.engine.base import Engine
    from services.inference_router.engine.cpu import CPUEngine
    from services.inference_router.engine.tp import TPEngine
    from services.inference_router.engine.vllm_engine import VLLMEngine


@dataclass(frozen=True)
class WeightVersions:
    """Which versions a replica holds; -1 is none."""

    serving: int
    staged: int = -1
    """The version being staged (complete or not), not yet committed."""
    rollback: int = -1
    """The version a rollback of the serving one would serve again."""


class WeightLifecycle(abc.ABC):
    """Stage, commit, roll back and abort weight versions on one replica's engine. Commit and
    rollback are never called concurrently (the replica serialises them); stage is serialised per rank."""

    def __init__(self, engine: Engine, primary: WeightStager) -> None:
        self.engine = engine
        self.primary = primary
        """Rank 0's stager: it speaks for the whole group (every rank commits and rolls back together)."""

    @abc.abstractmethod
    async def stage(self, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        """Stage one bucket for `msg.rank`: {"version", "bytes_received", "complete"} of that rank."""

    @abc.abstractmethod
    async def commit(self, version: int) -> None:
        """Serve `version`, staged complete on every rank, from the next decode step on."""

    @abc.abstractmethod
    async def rollback(self, version: int) -> int:
        """Stop serving `version`; serve the version before it again. Returns that version."""

    @abc.abstractmethod
    async def abort(self, version: int) -> None:
        """Drop `version` where it is staged (nothing happens where it is not)."""

    @abc.abstractmethod
    async def install(
        self, version: int, state_dict: Mapping[str, torch.Tensor], config: ModelConfig
    ) -> None:
        """Serve a full HF state dict as `version` (a model path, tests), bypassing staging."""

    def serving_version(self) -> int:
        return self.engine.status().weight_version

    def versions(self) -> WeightVersions:
        staged, rollback = self.primary.staged_version, self.primary.rollback_version
        return WeightVersions(
            self.serving_version(),
            -1 if staged is None else staged,
            -1 if rollback is None else rollback,
        )

    def holds(self, version: int) -> bool:
        """Whether `version` is served or was committed here (a retried rollback asks)."""
        return self.serving_version() >= version or self.primary.serving_version >= version

    def _stage_here(self, stager: WeightStager, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        stager.serving_version = max(stager.serving_version, self.serving_version())
        return asdict(stager.stage(msg))


class LocalWeights(WeightLifecycle):
    """A tp=1 CPU engine and its one stager."""

    engine: CPUEngine

    def __init__(self, engine: CPUEngine, stager: WeightStager) -> None:
        super().__init__(engine, stager)
        # The state dict the engine serves, as the stager handed it over: given back to the stager
        # when the next version retires it (the rollback point).
        self._held: dict[str, torch.Tensor] = {}

    async def stage(self, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        return await asyncio.to_thread(self._stage_here, self.primary, msg)

    async def commit(self, version: int) -> None:
        state = self.primary.commit(version)
        try:
            await self.engine.load_weights(version, state)
        except Exception:
            self.primary.recycle(state)
            raise
        retired, self._held = self._held, state
        self.primary.give_back(retired)

    async def rollback(self, version: int) -> int:
        try:
            previous, state = self.primary.rollback(version)
        except Exception as exc:
            raise errors.FailedPrecondition(str(exc)) from None
        try:
            await self.engine.rollback(previous, state)
        except Exception:
            self.primary.serving_version = version  # it still serves the rejected version
            self.primary.recycle(state)
            raise
        retired, self._held = self._held, state
        self.primary.recycle(retired)  # a rejected version is never served again
        return previous

    async def abort(self, version: int) -> None:
        self.primary.abort(version)

    async def install(
        self, version: int, state_dict: Mapping[str, torch.Tensor], config: ModelConfig
    ) -> None:
        await self.engine.load_weights(version, state_dict)
        self.primary.serving_version = max(self.primary.serving_version, version)
        self._held = dict(self.engine.executor.model.params)


class TPGroupWeights(WeightLifecycle):
    """A TP group: rank 0's stager in this process, the other ranks' on their worker actors."""

    engine: TPEngine

    def __init__(self, engine: TPEngine) -> None:
        super().__init__(engine, engine.rank0.stager)

    async def stage(self, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        if msg.rank == 0:
            return await asyncio.to_thread(self._stage_here, self.primary, msg)
        # The bytes as received (a decoded request keeps them): forwarding needs no re-encoding.
        return await self.engine.stage(msg.rank, msg.SerializeToString())

    async def commit(self, version: int) -> None:
        await self.engine.commit(version)

    async def rollback(self, version: int) -> int:
        return await self.engine.rollback_weights(version)

    async def abort(self, version: int) -> None:
        await self.engine.abort_staged(version)

    async def install(
        self, version: int, state_dict: Mapping[str, torch.Tensor], config: ModelConfig
    ) -> None:
        await self.engine.load_weights(version, state_dict)
        self.primary.serving_version = max(self.primary.serving_version, version)


class RankStagedWeights(WeightLifecycle):
    """vLLM: one stager per TP rank in this process; the ranks' vLLM workers swap together."""

    engine: VLLMEngine

    def __init__(self, engine: VLLMEngine, stagers: list[WeightStager], layout: Layout) -> None:
        super().__init__(engine, stagers[0])
        self.stagers = stagers
        self.layout = layout
        self._held: list[dict[str, torch.Tensor]] = []  # what each rank's worker serves

    async def stage(self, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        return await asyncio.to_thread(self._stage_here, self.stagers[msg.rank], msg)

    async def commit(self, version: int) -> None:
        """Every rank complete and verified, then one swap of all ranks; if the swap fails the
        stagers go back to the version still served (the sender retries the whole version)."""
        for stager in self.stagers:
            if not stager.is_complete(version):
                stager.commit(version)  # raises IncompleteVersion naming what is missing
        previous = [st.serving_version for st in self.stagers]
        states = [st.commit(version) for st in self.stagers]
        try:
            await self.engine.swap(version, states)
        except Exception:
            for stager, served, state in zip(self.stagers, previous, states, strict=True):
                stager.serving_version = served
                stager.recycle(state)
            raise
        retired = self._held or [{} for _ in states]
        self._held = states
        for stager, old in zip(self.stagers, retired, strict=True):
            stager.give_back(old)

    async def rollback(self, version: int) -> int:
        try:
            back = [st.rollback(version) for st in self.stagers]
        except Exception as exc:
            for stager in self.stagers:
                stager.serving_version = version
            raise errors.FailedPrecondition(str(exc)) from None
        previous = back[0][0]
        try:
            await self.engine.swap(previous, [state for _, state in back], allow_older=True)
        except Exception:
            for stager, (_, state) in zip(self.stagers, back, strict=True):
                stager.serving_version = version
                stager.recycle(state)
            raise
        retired, self._held = self._held, [state for _, state in back]
        for stager, old in zip(self.stagers, retired, strict=True):
            stager.recycle(old)
        return previous

    async def abort(self, version: int) -> None:
        for stager in self.stagers:
            stager.abort(version)

    async def install(
        self, version: int, state_dict: Mapping[str, torch.Tensor], config: ModelConfig
    ) -> None:
        shards = [shard_state_dict(state_dict, config, self.layout, r) for r in range(self.layout.tp_size)]
        await self.engine.swap(version, shards)
        for stager in self.stagers:
            stager.serving_version = max(stager.serving_version, version)
