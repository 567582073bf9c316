"""Token log-probabilities and entropies: the ONE definition trainer and samplers share.

Entry t of `token_logprobs` is log p(input_ids[t] | earlier tokens of its sequence) under
softmax(logits / temperature), with the logits of position t-1 predicting token t; the first token
of each sequence has no prediction and gets 0. Samplers report `sampled_logprobs` under the same
distribution they sample from (logits / temperature, BEFORE any top-k/top-p truncation), so the
trainer's importance ratio starts at exactly 1 for on-policy data. Work is done in float32 and in
row chunks, so the [T, V] float32 temporaries never exceed one chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK_ROWS = 1024


def _check_temperature(temperature: float | Tensor) -> None:
    if isinstance(temperature, Tensor):
        if bool((temperature <= 0).any()):
            raise ValueError("temperature must be > 0 (greedy decoding reports log-probs at temperature 1)")
    elif not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature} (greedy decoding reports log-probs at temperature 1)"
        )


def _scaled(logits: Tensor, temperature: float | Tensor) -> Tensor:
    z = logits.float()
    if isinstance(temperature, Tensor):
        return z / temperature.float().to(z.device)[:, None]
    return z if temperature == 1.0 else z / temperature


def sampled_logprobs(logits: Tensor, token_ids: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """log softmax(logits[b] / temperature[b])[token_ids[b]] for logits [B, V] -> [B] float32.

    `temperature` is a float or a per-row tensor [B].
    """
    _check_temperature(temperature)
    out = []
    for start in range(0, logits.shape[0], _CHUNK_ROWS):
        stop = start + _CHUNK_ROWS
        temp = temperature[start:stop] if isinstance(temperature, Tensor) else temperature
        z = _scaled(logits[start:stop], temp)
        picked = z.gather(-1, token_ids[start:stop].long()[:, None])[:, 0]
        out.append(picked - torch.logsumexp(z, dim=-1))
    if not out:
        return torch.zeros(0, dtype=torch.float32, device=logits.device)
    return torch.cat(out)


def rows_entropy(logits: Tensor, temperature: float | Tensor) -> Tensor:
    """Entropy of softmax(logits[b] / temperature[b]) per row of logits [B, V] -> [B] float32."""
    out = []
    for start in range(0, logits.shape[0], _CHUNK_ROWS):
        stop = start + _CHUNK_ROWS
        temp = temperature[start:stop] if isinstance(temperature, Tensor) else temperature
        z = _scaled(logits[start:stop], temp)
        logp = torch.log_softmax(z, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    if not out:
        return torch.zeros(0, dtype=torch.float32, device=logits.device)
    return torch.cat(out)


def _sequence_starts(cu_seqlens: Tensor, total: int, device: torch.device) -> Tensor:
    starts = cu_seqlens[:-1].to(device).long()
    return starts[starts < total]  # empty sequences have no first token


def _check(logits: Tensor, input_ids: Tensor, cu_seqlens: Tensor) -> None:
    if logits.dim() != 2 or input_ids.dim() != 1 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"logits must be [T, V] and input_ids [T], got {tuple(logits.shape)} and {tuple(input_ids.shape)}"
        )
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != input_ids.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to T={input_ids.shape[0]}, got {cu_seqlens.tolist()}")


def token_logprobs(logits: Tensor, input_ids: Tensor, cu_seqlens: Tensor, temperature: float = 1.0) -> Tensor:
    """[T] float32: log-prob of each token given its sequence's earlier tokens; 0 at sequence starts.

    Differentiable with respect to `logits` (the trainer backpropagates through it).
    """
    _check(logits, input_ids, cu_seqlens)
    total = input_ids.shape[0]
    out = torch.zeros(total, dtype=torch.float32, device=logits.device)
    if total < 2:
        return out
    shifted = sampled_logprobs(logits[:-1], input_ids[1:], temperature)
    out = torch.cat([out[:1], shifted])
    return out.index_fill(0, _sequence_starts(cu_seqlens, total, out.device), 0.0)


def entropy(logits: Tensor, cu_seqlens: Tensor, temperature: float = 1.0) -> Tensor:
    """[T] float32: entropy of the distribution that predicted token t (aligned with token_logprobs)."""
    _check_temperature(temperature)
    total = logits.shape[0]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens must run from 0 to T={total}, got {cu_seqlens.tolist()}")
    out = torch.zeros(total, dtype=torch.float32, device=logits.device)
    if total < 2:
        return out
    out = torch.cat([out[:1], rows_entropy(logits[:-1], temperature)])
    return out.index_fill(0, _sequence_starts(cu_seqlens, total, out.device), 0.0)
