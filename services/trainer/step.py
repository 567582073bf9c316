"""One training step's math, shared by the trainer ranks (worker.py) and the single-process baseline
(bench/single_process_grpo.py), so the baseline measures the same step without the services.

`micro_batch_loss` is one packed micro-batch's share of the step loss: a forward pass that computes
a prompt shared by several samples once (services/modeling/shared_prefix.py) and runs the vocabulary
projection only where a trained token is predicted (a GRPO step's prompts are most of its tokens and
predict nothing that is trained), log-probs and entropies there, the frozen
reference's log-probs when a KL term needs them, and trainer/loss.py's policy loss. `accumulate`
runs it over a rank's micro-batches with backward; `apply_gradients` clips, skips a non-finite
norm, steps AdamW and the schedule. Collectives (FSDP, the ranks' agreement on a batch) stay in the
worker.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from services.modeling.logprobs import rows_entropy, sampled_logprobs
from services.modeling.shared_prefix import SharedPrefixLayout, share_prefixes
from services.trainer.batch import PackedMicroBatch
from services.trainer.loss import LossMetrics, StepNorm, policy_loss

if TYPE_CHECKING:  # the recipe schema (pydantic) is the caller's; the step only reads its fields
    from services.kit.config.recipe import AlgorithmSection


@dataclass
class StepSettings:
    """What the step needs beyond the batches: the recipe's loss knobs, its sampling temperature and
    Dr. GRPO's constant normaliser (TrainerSpec.loss_max_tokens; read by the "constant" aggregation)."""

    loss: AlgorithmSection
    temperature: float = 1.0
    max_tokens: int = 0
    share_prompts: bool = True
    """Compute a prompt shared by several sequences of a micro-batch once (the same loss and gradient
    up to float rounding; off only to measure what it saves)."""


def _scatter(values: Tensor, positions: Tensor, total: int) -> Tensor:
    """[R] values at `positions` of a [T] vector of zeros (differentiable in `values`)."""
    return torch.zeros(total, dtype=values.dtype, device=values.device).index_copy(0, positions, values)


def _prompt_layout(mb: PackedMicroBatch, trained_rows: Tensor) -> SharedPrefixLayout | None:
    """The micro-batch with each prompt its sequences share laid out once (None: nothing shared). A
    sequence's prompt is what precedes its first trained token (`trained_rows`, ascending)."""
    bounds = mb.cu_seqlens.tolist()
    trained = trained_rows.tolist()
    first_trained, t = [], 0
    for start, end in itertools.pairwise(bounds):
        while t < len(trained) and trained[t] < start:
            t += 1
        first_trained.append(trained[t] - start if t < len(trained) and trained[t] < end else end - start)
    return share_prefixes(mb.input_ids, mb.position_ids, mb.cu_seqlens, first_trained)


def _predicted(
    model: Any,
    mb: PackedMicroBatch,
    rows: Tensor,
    targets: Tensor,
    settings: StepSettings,
    layout: SharedPrefixLayout | None,
):
    if layout is None:
        logits = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, logits_at=rows)
    else:
        logits = model(
            layout.input_ids,
            layout.position_ids,
            layout.cu_seqlens,
            logits_at=layout.row_of.index_select(0, rows),
            segments=layout.segments,
        )
    return logits, sampled_logprobs(logits, targets, settings.temperature)


def micro_batch_loss(
    model: Any,
    mb: PackedMicroBatch,
    settings: StepSettings,
    trainer_version: int,
    ref_model: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss (carrying the graph) and its metric sums."""
    total = mb.num_tokens
    trained = torch.nonzero(mb.loss_mask[1:] > 0).flatten() + 1  # tokens whose log-prob is trained
    # A padding micro-batch trains nothing, but its backward must still reach every parameter (FSDP
    # reduces gradients collectively): one row keeps the graph, weighted 0.
    rows = trained - 1 if trained.numel() else torch.zeros(1, dtype=torch.long, device=mb.input_ids.device)
    targets = mb.input_ids[trained] if trained.numel() else mb.input_ids[:1]
    layout = _prompt_layout(mb, trained) if settings.share_prompts else None
    logits, logp_rows = _predicted(model, mb, rows, targets, settings, layout)
    if trained.numel() == 0:
        share = logits.sum() * 0.0
        return share, {"loss": 0.0, "tokens": 0.0, "sequences": float(mb.num_sequences)}
    # The entropy carries a gradient only when the loss has an entropy bonus.
    entropy = rows_entropy(
        logits if settings.loss.entropy_coef > 0 else logits.detach(), settings.temperature
    )
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = _scatter(_predicted(ref_model, mb, rows, targets, settings, layout)[1], trained, total)
    return policy_loss(
        _scatter(logp_rows, trained, total),
        mb.behaviour_logprobs,
        mb.advantages,
        mb.loss_mask,
        mb.cu_seqlens,
        settings.loss,
        StepNorm(mb.global_loss_tokens, mb.global_sequences, settings.max_tokens),
        ref_logprobs=ref,
        entropy=_scatter(entropy, trained, total),
        versions=mb.versions,
        trainer_version=trainer_version,
    )


@dataclass
class Accumulated:
    """One rank's sums over its micro-batches (reduced across ranks by the caller)."""

    metrics: LossMetrics
    tokens: int
    max_staleness: int


def accumulate(
    model: Any,
    micro_batches: list[PackedMicroBatch],
    settings: StepSettings,
    trainer_version: int,
    ref_model: Any = None,
    loss_scale: float = 1.0,
) -> Accumulated:
    """Forward and backward over the micro-batches (gradients add up); `loss_scale` undoes a
    gradient average the caller's parallelism applies (FSDP averages over ranks)."""
    sums, tokens, staleness = LossMetrics(), 0, 0
    for mb in micro_batches:
        share, metrics = micro_batch_loss(model, mb, settings, trainer_version, ref_model)
        (share * loss_scale).backward()
        sums.add(metrics)
        tokens += mb.num_tokens
        trained = mb.loss_mask > 0
        if bool(trained.any()):
            staleness = max(staleness, int((trainer_version - mb.versions[trained]).max()))
    return Accumulated(sums, tokens, staleness)


def apply_gradients(
    model: Any, optimizer: Any, scheduler: Any, grad_clip: float
) -> tuple[float, bool, float]:
    """Clip, then AdamW unless the norm is not finite (the step is then skipped, the schedule still
    advances); returns (grad norm, skipped, the learning rate the step used)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = 0.0
    if params:
        total = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    lr = scheduler.get_last_lr()[0]
    skipped = not math.isfinite(norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    scheduler.step()
    return norm, skipped, lr
