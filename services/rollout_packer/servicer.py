"""RolloutPackerService: NextBatch streams a rank's micro-batches of a step, AckStep, Stats."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import grpc

from looprl.packer.v1 import packer_pb2, packer_pb2_grpc
from services.kit.messages import micro_batch
from services.kit.messages.array_codec import array_to_proto
from services.kit.rpc.errors import InvalidArgument, NotFound
from services.rollout_packer.packing import PackedMicroBatch
from services.rollout_packer.run_packer import RunPacker


def micro_batch_to_proto(mb: PackedMicroBatch) -> packer_pb2.MicroBatch:
    return packer_pb2.MicroBatch(
        step=mb.step,
        rank=mb.rank,
        index=mb.index,
        count=mb.count,
        **{name: array_to_proto(getattr(mb, name)) for name in micro_batch.TENSORS},
        rollout_ids=mb.rollout_ids,
        num_tokens=mb.num_tokens,
        global_loss_tokens=mb.global_loss_tokens,
        global_sequences=mb.global_sequences,
    )


class RolloutPackerServicer(packer_pb2_grpc.RolloutPackerServiceServicer):
    def __init__(self, lookup: Callable[[str], RunPacker | None]) -> None:
        self._lookup = lookup

    def _run(self, run_id: str) -> RunPacker:
        if not run_id:
            raise InvalidArgument("run_id: must not be empty")
        packer = self._lookup(run_id)
        if packer is None:
            raise NotFound(f"run_id: no run {run_id!r} is being packed (unknown or not started)")
        return packer

    async def NextBatch(
        self, request: packer_pb2.NextBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[packer_pb2.NextBatchResponse]:
        if request.step < 0:
            raise InvalidArgument(f"step: must be >= 0, got {request.step}")
        if request.world_size <= 0:
            raise InvalidArgument(f"world_size: must be > 0, got {request.world_size}")
        if not 0 <= request.rank < request.world_size:
            raise InvalidArgument(
                f"rank: must be in [0, world_size={request.world_size}), got {request.rank}"
            )
        if request.trainer_version < 0:
            raise InvalidArgument(f"trainer_version: must be >= 0, got {request.trainer_version}")
        if not math.isfinite(request.timeout_seconds) or request.timeout_seconds < 0:
            raise InvalidArgument(f"timeout_seconds: must be >= 0, got {request.timeout_seconds}")
        packer = self._run(request.run_id)
        timeout = request.timeout_seconds or None
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout or math.inf, max(0.001, remaining - 0.05))
        batch = await packer.step_batch(request.step, request.world_size, request.trainer_version, timeout)
        reward_mean, reward_std = batch.reward_stats
        for j in range(batch.plan.micro_batches_per_rank):
            message = micro_batch_to_proto(batch.micro_batch(request.rank, j))
            message.step_reward_mean, message.step_reward_std = reward_mean, reward_std
            message.rollout_traceparents.extend(packer.traceparents.get(r, "") for r in message.rollout_ids)
            yield packer_pb2.NextBatchResponse(micro_batch=message)

    async def AckStep(
        self, request: packer_pb2.AckStepRequest, context: grpc.aio.ServicerContext
    ) -> packer_pb2.AckStepResponse:
        if request.step < 0:
            raise InvalidArgument(f"step: must be >= 0, got {request.step}")
        if request.trainer_version < 0:
            raise InvalidArgument(f"trainer_version: must be >= 0, got {request.trainer_version}")
        packer = self._run(request.run_id)
        return packer_pb2.AckStepResponse(
            acked_rollouts=await packer.ack_step(request.step, request.trainer_version)
        )

    async def Stats(
        self, request: packer_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> packer_pb2.StatsResponse:
        packer = self._run(request.run_id)
        last = packer.last_batch
        return packer_pb2.StatsResponse(
            queued_rollouts=packer.queued_rollouts,
            pending_groups=packer.pending_groups,
            padding_fraction=last.plan.padding_fraction if last else 0.0,
            rank_imbalance=last.plan.rank_imbalance if last else 0.0,
            dropped=dict(packer.dropped),
            packed_steps=packer.steps_planned,
            acked_rollouts=packer.acked_total,
        )
