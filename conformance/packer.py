"""The rollout-packer contract (looprl.packer.v1.RolloutPackerService): micro-batches laid out as
MicroBatch documents them, a step served identically until the trainer acknowledges it, an
acknowledgement that counts each rollout once, deadlines that hold, and refusals naming the field.

With `--option run=RUN` the kit acts as that run's trainer (one rank): it takes step
`--option step=N` (default 0), checks it, acknowledges it and asks for the next one with a short
timeout. Use a run no real trainer consumes (a packer given a static run, fed rollouts by hand): an
acknowledgement is final. Without a run only the refusals are checked.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from conformance.case import Contract, check, skip
from conformance.common import add_common, health
from conformance.target import Session
from looprl.common.v1 import common_pb2
from looprl.packer.v1 import packer_pb2 as pb

SERVICE = "looprl.packer.v1.RolloutPackerService"
contract = Contract(
    "rollout-packer",
    SERVICE,
    "a trainer step's packed micro-batches per rank (NextBatch), AckStep, Stats",
    options={
        "run": "a run the packer packs and no trainer consumes (the kit takes and acknowledges its steps)",
        "step": "the step to take (default 0)",
        "wait": "seconds to wait for the step to fill (default 60)",
    },
)
add_common(contract, "Stats", pb.StatsRequest(run_id="conformance-no-such-run"))

NO_RUN = "conformance-no-such-run"
DTYPES = {
    common_pb2.D_TYPE_FLOAT32: np.float32,
    common_pb2.D_TYPE_INT32: np.int32,
    common_pb2.D_TYPE_INT64: np.int64,
}


def tensor(t: common_pb2.Tensor, name: str, dtype: int) -> np.ndarray:
    check(
        t.dtype == dtype,
        f"{name}: dtype {common_pb2.DType.Name(t.dtype)}, not {common_pb2.DType.Name(dtype)}",
    )
    array = np.frombuffer(t.data, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"))
    check(list(t.shape) == [array.size], f"{name}: shape {list(t.shape)} for {array.size} elements")
    return array


def _run(s: Session) -> str:
    run = s.option("run")
    if not run:
        skip("no --option run=RUN: the step cases need a run whose steps the kit may take")
    return run


def _next_batch(
    s: Session,
    step: int,
    world_size: int = 1,
    timeout_seconds: float | None = None,
    deadline: float | None = None,
) -> list[pb.MicroBatch]:
    wait = float(s.option("wait", "60")) if timeout_seconds is None else timeout_seconds
    request = pb.NextBatchRequest(
        run_id=_run(s),
        step=step,
        rank=0,
        world_size=world_size,
        trainer_version=max(step, 0),
        timeout_seconds=wait,
    )
    replies = s.unary_stream("NextBatch", request, pb.NextBatchResponse, timeout=deadline or wait + 30)
    return [r.micro_batch for r in replies]


def check_micro_batches(batches: list[pb.MicroBatch], step: int, rank: int) -> dict[str, int]:
    """Every promise of MicroBatch; returns the step's loss tokens, sequences and rollout ids."""
    check(batches, "NextBatch streamed no micro-batch")
    loss_tokens = sequences = 0
    ids: set[str] = set()
    for j, mb in enumerate(batches):
        where = f"micro-batch {j}"
        check(
            mb.step == step and mb.rank == rank,
            f"{where}: step/rank {mb.step}/{mb.rank}, asked {step}/{rank}",
        )
        check(
            mb.index == j and mb.count == len(batches),
            f"{where}: index/count {mb.index}/{mb.count}, streamed {j} of {len(batches)}",
        )
        T = mb.num_tokens
        ids_ = tensor(mb.input_ids, f"{where}.input_ids", common_pb2.D_TYPE_INT32)
        check(ids_.size == T and T > 0, f"{where}: {ids_.size} input_ids, num_tokens {T}")
        cu = tensor(mb.cu_seqlens, f"{where}.cu_seqlens", common_pb2.D_TYPE_INT32)
        check(
            cu.size >= 2 and cu[0] == 0 and cu[-1] == T and bool(np.all(np.diff(cu) > 0)),
            f"{where}: cu_seqlens {cu.tolist()[:12]} for {T} tokens",
        )
        positions = tensor(mb.position_ids, f"{where}.position_ids", common_pb2.D_TYPE_INT32)
        expected = np.concatenate([np.arange(b - a) for a, b in itertools.pairwise(cu)])
        check(np.array_equal(positions, expected), f"{where}: position_ids do not restart at 0 per sequence")
        mask = tensor(mb.loss_mask, f"{where}.loss_mask", common_pb2.D_TYPE_FLOAT32)
        check(
            mask.size == T and bool(np.all((mask == 0) | (mask == 1))),
            f"{where}: loss_mask not 0/1 per token",
        )
        adv = tensor(mb.advantages, f"{where}.advantages", common_pb2.D_TYPE_FLOAT32)
        lp = tensor(mb.behaviour_logprobs, f"{where}.behaviour_logprobs", common_pb2.D_TYPE_FLOAT32)
        for name, values in (("advantages", adv), ("behaviour_logprobs", lp)):
            check(
                values.size == T and bool(np.all(np.isfinite(values))),
                f"{where}.{name}: not {T} finite values",
            )
            check(bool(np.all(values[mask == 0] == 0)), f"{where}.{name}: non-zero outside the loss mask")
        check(bool(np.all(lp[mask == 1] <= 1e-6)), f"{where}.behaviour_logprobs: a log-prob above 0")
        versions = tensor(mb.versions, f"{where}.versions", common_pb2.D_TYPE_INT64)
        check(versions.size == T, f"{where}.versions: {versions.size} for {T} tokens")
        check(
            not mb.rollout_traceparents or len(mb.rollout_traceparents) == len(mb.rollout_ids),
            f"{where}: {len(mb.rollout_traceparents)} traceparents for {len(mb.rollout_ids)} rollouts",
        )
        loss_tokens += int(mask.sum())
        sequences += len(mb.rollout_ids)
        ids.update(mb.rollout_ids)
        check(
            math.isfinite(mb.step_reward_mean) and math.isfinite(mb.step_reward_std),
            f"{where}: step reward {mb.step_reward_mean} +- {mb.step_reward_std}",
        )
    return {"loss_tokens": loss_tokens, "sequences": sequences, "rollouts": len(ids)}


def _invalid(s: Session, method: str, request, response, field: str, code: str = "INVALID_ARGUMENT") -> None:
    call = (
        (lambda: s.unary_stream(method, request, response))
        if method == "NextBatch"
        else (lambda: s.unary(method, request, response))
    )
    s.refused(code, call, naming=field)


def _validation_case(id: str, method: str, field: str, request, response, proto: str, quote: str) -> None:
    contract.add(
        id,
        method,
        f"{field} out of range is refused naming it",
        "INVALID_ARGUMENT",
        proto,
        quote,
        lambda s: _invalid(s, method, request, response, field),
    )


_RUN = "conformance-any-run"
_validation_case(
    "next_batch.run_id",
    "NextBatch",
    "run_id",
    pb.NextBatchRequest(world_size=1),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.run_id",
    "empty: INVALID_ARGUMENT",
)
_validation_case(
    "next_batch.step",
    "NextBatch",
    "step",
    pb.NextBatchRequest(run_id=_RUN, step=-1, world_size=1),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.step",
    ">= 0",
)
_validation_case(
    "next_batch.world_size",
    "NextBatch",
    "world_size",
    pb.NextBatchRequest(run_id=_RUN, world_size=0),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.world_size",
    ">= 1",
)
_validation_case(
    "next_batch.rank",
    "NextBatch",
    "rank",
    pb.NextBatchRequest(run_id=_RUN, rank=2, world_size=2),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.rank",
    "in [0, world_size)",
)
_validation_case(
    "next_batch.trainer_version",
    "NextBatch",
    "trainer_version",
    pb.NextBatchRequest(run_id=_RUN, world_size=1, trainer_version=-1),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.trainer_version",
    ">= 0",
)
_validation_case(
    "next_batch.timeout_seconds",
    "NextBatch",
    "timeout_seconds",
    pb.NextBatchRequest(run_id=_RUN, world_size=1, timeout_seconds=-1),
    pb.NextBatchResponse,
    "looprl.packer.v1.NextBatchRequest.timeout_seconds",
    "negative or not finite: INVALID_ARGUMENT",
)
_validation_case(
    "ack_step.step",
    "AckStep",
    "step",
    pb.AckStepRequest(run_id=_RUN, step=-1),
    pb.AckStepResponse,
    "looprl.packer.v1.AckStepRequest.step",
    ">= 0",
)
_validation_case(
    "ack_step.trainer_version",
    "AckStep",
    "trainer_version",
    pb.AckStepRequest(run_id=_RUN, trainer_version=-1),
    pb.AckStepResponse,
    "looprl.packer.v1.AckStepRequest.trainer_version",
    ">= 0",
)


@contract.case(
    "unknown_run",
    "NextBatch",
    "a run the packer does not pack is refused naming `run_id`, by every RPC",
    "NOT_FOUND",
    "looprl.packer.v1.NextBatchRequest.run_id",
    "not packed here: NOT_FOUND",
)
def _unknown_run(s: Session) -> None:
    _invalid(
        s,
        "NextBatch",
        pb.NextBatchRequest(run_id=NO_RUN, world_size=1, timeout_seconds=1),
        pb.NextBatchResponse,
        "run_id",
        "NOT_FOUND",
    )
    _invalid(s, "AckStep", pb.AckStepRequest(run_id=NO_RUN), pb.AckStepResponse, "run_id", "NOT_FOUND")
    _invalid(s, "Stats", pb.StatsRequest(run_id=NO_RUN), pb.StatsResponse, "run_id", "NOT_FOUND")


@contract.case(
    "next_batch.micro_batches",
    "NextBatch",
    "streams count micro-batches in index order whose tensors are laid out as documented",
    "OK",
    "looprl.packer.v1.MicroBatch",
    "All per-token tensors have num_tokens elements",
)
def _micro_batches(s: Session) -> None:
    step = int(s.option("step", "0"))
    batches = _next_batch(s, step)
    s.facts["step"], s.facts["batches"] = step, batches
    s.facts["counts"] = check_micro_batches(batches, step, 0)


@contract.case(
    "next_batch.global_counts",
    "NextBatch",
    "global_loss_tokens and global_sequences count the whole step",
    "OK",
    "looprl.packer.v1.MicroBatch.global_loss_tokens",
    "Number of loss tokens in the whole step (all ranks)",
)
def _global_counts(s: Session) -> None:
    counts = s.need("counts", "no step was taken (rollout-packer.next_batch.micro_batches)")
    for mb in s.facts["batches"]:
        check(
            mb.global_loss_tokens == counts["loss_tokens"],
            f"global_loss_tokens {mb.global_loss_tokens}, the step has {counts['loss_tokens']}",
        )
        check(
            mb.global_sequences == counts["sequences"],
            f"global_sequences {mb.global_sequences}, the step has {counts['sequences']}",
        )


@contract.case(
    "next_batch.served_again",
    "NextBatch",
    "a step asked again before AckStep streams the same micro-batches",
    "OK",
    "looprl.packer.v1.RolloutPackerService.NextBatch",
    "the same micro-batches until AckStep",
)
def _served_again(s: Session) -> None:
    batches = s.need("batches", "no step was taken (rollout-packer.next_batch.micro_batches)")
    again = _next_batch(s, s.facts["step"])
    check(
        [b.SerializeToString(deterministic=True) for b in again]
        == [b.SerializeToString(deterministic=True) for b in batches],
        "the step came back different the second time",
    )


@contract.case(
    "next_batch.world_size_fixed",
    "NextBatch",
    "a step planned for one world size is refused for another",
    "FAILED_PRECONDITION",
    "looprl.packer.v1.NextBatchRequest.world_size",
    "another world size: FAILED_PRECONDITION",
)
def _world_size_fixed(s: Session) -> None:
    step = s.need("step", "no step was taken (rollout-packer.next_batch.micro_batches)")
    s.refused("FAILED_PRECONDITION", lambda: _next_batch(s, step, world_size=2), naming="world_size")


@contract.case(
    "ack_step.counts",
    "AckStep",
    "acknowledges each rollout of the step once",
    "OK",
    "looprl.packer.v1.AckStepResponse.acked_rollouts",
    "each rollout of the step once",
)
def _ack(s: Session) -> None:
    step = s.need("step", "no step was taken (rollout-packer.next_batch.micro_batches)")
    reply = s.unary(
        "AckStep", pb.AckStepRequest(run_id=_run(s), step=step, trainer_version=step + 1), pb.AckStepResponse
    )
    rollouts = s.facts["counts"]["rollouts"]
    check(
        reply.acked_rollouts == rollouts,
        f"acked_rollouts {reply.acked_rollouts}, the step holds {rollouts} rollouts",
    )
    s.facts["acked"] = True


@contract.case(
    "ack_step.idempotent",
    "AckStep",
    "acknowledging a step again acknowledges nothing more",
    "OK",
    "looprl.packer.v1.AckStepResponse.acked_rollouts",
    "0 when the step was acknowledged before",
)
def _ack_again(s: Session) -> None:
    step = s.need("step", "no step was taken (rollout-packer.next_batch.micro_batches)")
    s.need("acked", "the step was not acknowledged (rollout-packer.ack_step.counts)")
    reply = s.unary(
        "AckStep", pb.AckStepRequest(run_id=_run(s), step=step, trainer_version=step + 1), pb.AckStepResponse
    )
    check(reply.acked_rollouts == 0, f"acknowledged {reply.acked_rollouts} rollouts again")


@contract.case(
    "next_batch.after_ack",
    "NextBatch",
    "an acknowledged step is never served again",
    "FAILED_PRECONDITION",
    "looprl.packer.v1.NextBatchRequest.step",
    "acknowledged: FAILED_PRECONDITION",
)
def _after_ack(s: Session) -> None:
    step = s.need("step", "no step was taken (rollout-packer.next_batch.micro_batches)")
    s.need("acked", "the step was not acknowledged (rollout-packer.ack_step.counts)")
    s.refused("FAILED_PRECONDITION", lambda: _next_batch(s, step), naming="step")


@contract.case(
    "ack_step.unplanned",
    "AckStep",
    "acknowledging a step that was never planned is refused naming `step`",
    "FAILED_PRECONDITION",
    "looprl.packer.v1.AckStepRequest.step",
    "never planned: FAILED_PRECONDITION",
)
def _ack_unplanned(s: Session) -> None:
    step = int(s.option("step", "0")) + 100_000
    s.refused(
        "FAILED_PRECONDITION",
        lambda: s.unary("AckStep", pb.AckStepRequest(run_id=_run(s), step=step), pb.AckStepResponse),
        naming="step",
    )


@contract.case(
    "next_batch.timeout",
    "NextBatch",
    "a step that does not fill within timeout_seconds ends the stream with DEADLINE_EXCEEDED, and the packer keeps serving",
    "DEADLINE_EXCEEDED",
    "looprl.packer.v1.NextBatchRequest.timeout_seconds",
    "DEADLINE_EXCEEDED once it has passed",
)
def _timeout(s: Session) -> None:
    step = s.need("step", "no step was taken (rollout-packer.next_batch.micro_batches)") + 1
    started = time.monotonic()
    try:
        batches = _next_batch(s, step, timeout_seconds=0.5, deadline=30)
    except Exception as exc:
        code = getattr(exc, "code", lambda: None)()
        check(
            code is not None and code.name == "DEADLINE_EXCEEDED",
            f"answered {code.name if code else exc}, expected DEADLINE_EXCEEDED",
        )
        check(
            time.monotonic() - started < 10,
            f"answered after {time.monotonic() - started:.1f}s for a 0.5 s timeout",
        )
    else:  # rollouts for the next step were already there: it may be served, and is taken back
        check_micro_batches(batches, step, 0)
        s.unary(
            "AckStep",
            pb.AckStepRequest(run_id=_run(s), step=step, trainer_version=step + 1),
            pb.AckStepResponse,
        )
    check(health(s) == "SERVING", "the packer stopped serving after a NextBatch timed out")


@contract.case(
    "stats.counters",
    "Stats",
    "counters are non-negative and include the rollouts acknowledged",
    "OK",
    "looprl.packer.v1.StatsResponse.acked_rollouts",
    "acknowledged so far",
)
def _stats(s: Session) -> None:
    reply = s.unary("Stats", pb.StatsRequest(run_id=_run(s)), pb.StatsResponse)
    for name in ("queued_rollouts", "pending_groups", "packed_steps", "acked_rollouts"):
        check(getattr(reply, name) >= 0, f"{name} is {getattr(reply, name)}")
    check(0 <= reply.padding_fraction <= 1, f"padding_fraction {reply.padding_fraction}")
    check(all(v >= 0 for v in reply.dropped.values()), f"dropped {dict(reply.dropped)}")
    if s.facts.get("acked"):
        check(
            reply.acked_rollouts >= s.facts["counts"]["rollouts"],
            f"acked_rollouts {reply.acked_rollouts} < the {s.facts['counts']['rollouts']} the kit acknowledged",
        )
        check(reply.packed_steps >= 1, "packed_steps 0 after a step was served")
