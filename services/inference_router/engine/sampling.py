"""Batched token sampling with per-sequence parameters and per-sequence random generators.

Every running sequence carries its own temperature/top-k/top-p and its own torch.Generator, so a
seeded request samples the same tokens whatever else shares its batch. The reported log-prob is
the one documented in engine/base.py: log softmax(logits / T) over the full vocabulary, before any
truncation; greedy (T = 0) reports it under T = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.modeling.logprobs import sampled_logprobs


@dataclass
class SamplerRow:
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()  # nondeterministic
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> tuple[list[int], list[float]]:
    """Sample one token per row of logits [B, V]; return (token ids, their log-probs).

    Inverse-CDF sampling over the batch: each row draws one uniform from its own generator (so its
    token depends on its seed and logits only, never on its neighbours), then one cumsum and one
    searchsorted pick every row's token. One small tensor op per row instead of a multinomial call
    per row: the sampler was ~6 ms of a 64-sequence decode step."""
    logits = logits.float()
    device = logits.device  # the engine's (a CUDA engine samples on its GPU)
    temps = torch.tensor(
        [r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=torch.float32, device=device
    )
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = logp.exp()
    for i, row in enumerate(rows):
        if row.temperature > 0.0 and (row.top_k > 0 or row.top_p < 1.0):
            probs[i] = _truncate(probs[i], row.top_k, row.top_p)
    uniforms = torch.tensor(
        [0.0 if row.temperature == 0.0 else float(torch.rand((), generator=row.generator)) for row in rows],
        dtype=torch.float64,
        device=device,
    )
    cdf = probs.double().cumsum(dim=-1)
    sampled = torch.tensor([row.temperature > 0.0 for row in rows], device=device)
    if not bool(torch.isfinite(cdf[sampled, -1]).all()):
        raise RuntimeError("sampling: the model's logits hold NaN or inf; no token can be drawn")
    # The first token whose cumulative mass exceeds u * total: a zero-probability token never is.
    drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
    drawn = drawn.clamp_(max=logits.shape[-1] - 1)
    chosen_ids = torch.where(sampled, drawn, logits.argmax(dim=-1))
    # The shared definition the trainer uses too (services/modeling/logprobs.py).
    chosen = sampled_logprobs(logits, chosen_ids, temps)
    return chosen_ids.tolist(), chosen.tolist()


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero every token outside the top-k and outside the smallest top-p nucleus (unnormalized)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    out = torch.zeros_like(probs)
    out.scatter_(0, order, kept)
    return out
