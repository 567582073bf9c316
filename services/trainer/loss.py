"""Token-level policy-gradient loss (PPO-clip / GRPO family) on packed micro-batches.

One formula, several knobs, chosen to cover what verl / OpenRLHF / prime-rl / DAPO / Dr. GRPO do:

* importance ratio per token ``r = exp(logp - behaviour_logp)`` against the log-probs the sampler
  reported (one optimizer step per trainer step, so the behaviour policy *is* the "old" policy);
* PPO clip with asymmetric bounds ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher);
* truncated importance sampling for stale rollouts: the unclipped term uses ``r`` whose
  *gradient weight* is capped at ``tis_cap`` (value ``min(r, cap) * A``, gradient
  ``min(r, cap) * A * grad logp``), which bounds the update a very off-policy token can cause even
  when its advantage is negative (where PPO's min would keep the unbounded ``r * A``);
* optional KL to a frozen reference policy with the k3 estimator ``exp(q) - q - 1``,
  ``q = ref_logp - logp`` (unbiased, always >= 0);
* optional entropy bonus.

Aggregation is *global over the step*, so that splitting a step into micro-batches and ranks never
changes the objective: every micro-batch returns its share of the step loss, and the shares sum to
the step loss exactly.

* ``token-mean``: sum of token losses / the step's ``global_loss_tokens``;
* ``seq-mean-token-mean``: mean over the step's ``global_sequences`` of each sequence's mean token loss;
* ``constant`` (Dr. GRPO): sum of token losses / (``global_sequences * max_tokens``), a constant
  normaliser that removes the length bias of per-sequence means.

The knobs are the recipe's ``[algorithm]`` section (services/kit/config/recipe.py:AlgorithmSection), taken
as is and validated there; the Dr. GRPO normaliser ``max_tokens`` is derived from the recipe
(``sampling.max_tokens * environment.max_turns``, see TrainerSpec.loss_max_tokens) and travels in
:class:`StepNorm`.

Metrics are returned as *sums* with their counts so they can be all-reduced across micro-batches and
ranks and divided once at the end (see :class:`LossMetrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the recipe schema (pydantic) is the caller's; the step only reads its fields
    from services.kit.config.recipe import AlgorithmSection


@dataclass
class StepNorm:
    """Step-global sizes that make micro-batch shares add up to the step loss."""

    global_loss_tokens: int
    global_sequences: int
    # Dr. GRPO's constant normaliser (tokens per sequence), read by the "constant" aggregation only.
    max_tokens: int = 0


# Metric sums carried per micro-batch; each is divided by the named count at the end of the step.
METRIC_COUNTS = {
    "clip_fraction": "tokens",
    "tis_fraction": "tokens",
    "ratio": "tokens",
    "ratio_clipped": "tokens",
    "kl": "tokens",
    "entropy": "tokens",
    "staleness": "tokens",
}


# Metrics reduced by their largest value across micro-batches and ranks, not summed (the smallest
# ratio travels negated, so that one MAX all-reduce takes both).
METRIC_MAXIMA = ("ratio_max", "neg_ratio_min")


@dataclass
class LossMetrics:
    """Additive metric sums (token-weighted) and counts; reduce across ranks with one all-reduce.
    `maxima` (METRIC_MAXIMA) reduce with a MAX all-reduce of their own."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def add(self, other: dict[str, float]) -> None:
        for key, value in other.items():
            if key in METRIC_MAXIMA:
                self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def maxima_tensor(self) -> torch.Tensor:
        """METRIC_MAXIMA in order (-inf for none seen), for a MAX all-reduce."""
        return torch.tensor([self.maxima.get(k, -math.inf) for k in METRIC_MAXIMA], dtype=torch.float64)

    def keys(self) -> list[str]:
        return ["loss", "tokens", "sequences", *METRIC_COUNTS]

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.sums.get(k, 0.0) for k in self.keys()], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossMetrics:
        out = cls()
        out.sums = {k: float(v) for k, v in zip(out.keys(), values.tolist(), strict=True)}
        return out

    def finalize(self, maxima: torch.Tensor | None = None) -> dict[str, float]:
        """Means per token; ``loss`` is already the step loss (a sum of shares). `maxima`: the
        all-reduced `maxima_tensor()` (this object's own when None); 0 where no token was seen."""
        result = {"loss": self.sums.get("loss", 0.0)}
        tokens = max(self.sums.get("tokens", 0.0), 1.0)
        for key in METRIC_COUNTS:
            result[key] = self.sums.get(key, 0.0) / tokens
        values = (self.maxima_tensor() if maxima is None else maxima).tolist()
        seen = dict(zip(METRIC_MAXIMA, (v if math.isfinite(v) else 0.0 for v in values), strict=True))
        result["ratio_max"], result["ratio_min"] = seen["ratio_max"], -seen["neg_ratio_min"]
        result["loss_tokens"] = self.sums.get("tokens", 0.0)
        result["sequences"] = self.sums.get("sequences", 0.0)
        return result


def _sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)[
        :num_tokens
    ]


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: AlgorithmSection,
    norm: StepNorm,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    trainer_version: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss, and its metric sums.

    All per-token tensors are [T] and aligned with the packed ``input_ids`` (entry t is about
    token t). ``logprobs`` carries the graph; everything else is data.
    """
    mask = loss_mask.to(logprobs.dtype)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)

    log_ratio = (logprobs - behaviour) * mask  # masked first: exp of garbage outside the mask is not ours
    ratio = torch.exp(log_ratio)
    lower, upper = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    clipped_ratio = ratio.clamp(lower, upper)
    if cfg.tis_cap > 0:
        # Value min(r, cap), gradient min(r, cap) * grad logp: r times a constant factor <= 1.
        truncation = (cfg.tis_cap / ratio.detach()).clamp(max=1.0)
        unclipped_ratio = ratio * truncation
    else:
        unclipped_ratio = ratio
    token_loss = -torch.minimum(unclipped_ratio * adv, clipped_ratio * adv)

    kl = None
    if ref_logprobs is not None:
        q = (ref_logprobs.to(logprobs.dtype) - logprobs) * mask
        kl = torch.exp(q) - q - 1.0
        if cfg.kl_coef > 0:
            token_loss = token_loss + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        token_loss = token_loss - cfg.entropy_coef * entropy
    token_loss = token_loss * mask

    seq_ids = _sequence_ids(cu_seqlens, logprobs.shape[0])
    num_seqs = cu_seqlens.numel() - 1
    aggregation = cfg.loss_aggregation
    if aggregation == "token-mean":
        share = token_loss.sum() / max(norm.global_loss_tokens, 1)
    elif aggregation == "seq-mean-token-mean":
        per_seq = torch.zeros(num_seqs, dtype=token_loss.dtype, device=token_loss.device)
        per_seq = per_seq.index_add(0, seq_ids, token_loss)
        seq_tokens = torch.zeros(num_seqs, dtype=mask.dtype, device=mask.device).index_add(0, seq_ids, mask)
        share = (per_seq / seq_tokens.clamp(min=1.0)).sum() / max(norm.global_sequences, 1)
    elif aggregation == "constant":
        if norm.max_tokens <= 0:
            raise ValueError(f"StepNorm.max_tokens: Dr. GRPO needs its normaliser, got {norm.max_tokens}")
        per_seq = torch.zeros(num_seqs, dtype=token_loss.dtype, device=token_loss.device)
        per_seq = per_seq.index_add(0, seq_ids, token_loss)
        share = per_seq.sum() / (max(norm.global_sequences, 1) * norm.max_tokens)
    else:  # the recipe admits only the three above
        raise ValueError(f"algorithm.loss_aggregation: unknown aggregation {aggregation!r}")

    with torch.no_grad():
        trained = loss_mask > 0
        is_clipped = ((adv > 0) & (ratio > upper)) | ((adv < 0) & (ratio < lower))
        metrics = {
            "loss": float(share),
            "tokens": float(mask.sum()),
            "sequences": float(num_seqs),
            "clip_fraction": float((is_clipped.to(mask.dtype) * mask).sum()),
            "tis_fraction": float(((ratio > cfg.tis_cap).to(mask.dtype) * mask).sum())
            if cfg.tis_cap > 0
            else 0.0,
            "ratio": float((ratio * mask).sum()),
            # Outside the trust region whatever the advantage's sign: the sampler/trainer mismatch.
            "ratio_clipped": float((((ratio < lower) | (ratio > upper)).to(mask.dtype) * mask).sum()),
            "ratio_max": float(ratio[trained].max()) if bool(trained.any()) else -math.inf,
            "neg_ratio_min": -float(ratio[trained].min()) if bool(trained.any()) else -math.inf,
            "kl": float((kl * mask).sum()) if kl is not None else 0.0,
            "entropy": float((entropy.detach() * mask).sum()) if entropy is not None else 0.0,
            "staleness": 0.0,
        }
        if versions is not None and trainer_version is not None:
            metrics["staleness"] = float(
                ((trainer_version - versions.to(torch.float64)) * mask.double()).sum()
            )
    return share, metrics
