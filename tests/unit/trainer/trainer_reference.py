"""A naive single-process reference of the trainer's policy loss: per sequence, per token, in
float64 Python arithmetic on plain lists. Written independently of services/trainer/loss.py so the
two can disagree; used by the loss tests and by the 2-rank step test."""

from __future__ import annotations

import math

import torch


def reference_step_loss(
    sequences: list[dict],
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    kl_coef: float,
    entropy_coef: float,
    aggregation: str,
    max_tokens: int,
    logprob_fn,
) -> torch.Tensor:
    """The loss of a whole step. Each sequence is a dict with per-token lists (mask, adv,
    behaviour, optional ref) and ``logprob_fn(i)`` returns its [L] log-prob tensor with graph
    (and ``entropy`` in the dict when the entropy bonus is used)."""
    num_loss_tokens = sum(sum(s["mask"]) for s in sequences)
    per_sequence = []
    for i, seq in enumerate(sequences):
        logp = logprob_fn(i)
        terms = []
        for t in range(len(seq["mask"])):
            if not seq["mask"][t]:
                continue
            adv = seq["adv"][t]
            r = torch.exp(logp[t] - seq["behaviour"][t])
            r_value = float(r.detach())
            clipped = min(max(r_value, 1 - clip_low), 1 + clip_high)
            unclipped = r * (tis_cap / r_value) if tis_cap > 0 and r_value > tis_cap else r
            # The min of two surrogates, written with an explicit branch on which one wins.
            if float(unclipped.detach()) * adv <= clipped * adv:
                term = -(unclipped * adv)
            else:
                term = -(torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv)
            if "ref" in seq:
                q = seq["ref"][t] - logp[t]
                term = term + kl_coef * (torch.exp(q) - q - 1)
            if entropy_coef > 0:
                term = term - entropy_coef * seq["entropy"][t]
            terms.append(term)
        per_sequence.append((sum(terms) if terms else logp.sum() * 0.0, len(terms)))
    if aggregation == "token-mean":
        return sum(s for s, _ in per_sequence) / num_loss_tokens
    if aggregation == "seq-mean-token-mean":
        return sum(s / max(n, 1) for s, n in per_sequence) / len(sequences)
    if aggregation == "constant":
        return sum(s for s, _ in per_sequence) / (len(sequences) * max_tokens)
    raise ValueError(aggregation)


def reference_clip_fraction(
    sequences: list[dict], logps: list[torch.Tensor], clip_low: float, clip_high: float
):
    clipped = total = 0
    for seq, logp in zip(sequences, logps, strict=True):
        for t, m in enumerate(seq["mask"]):
            if not m:
                continue
            total += 1
            r = math.exp(float(logp[t]) - seq["behaviour"][t])
            adv = seq["adv"][t]
            clipped += (adv > 0 and r > 1 + clip_high) or (adv < 0 and r < 1 - clip_low)
    return clipped / total
