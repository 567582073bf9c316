"""Trained tokens/s on packed micro-batches vs pad-to-longest batches of the same rollouts.

Same weights, same kernels, same loss: the measured path is the trainer's packed forward
(services/modeling Qwen2ForCausalLM with cu_seqlens, micro-batches filled to a token budget,
first-fit decreasing) + the trainer's policy loss + backward; the baseline is the classic batched
layout: fixed-size batches of sequences in arrival order, right-padded to the batch's longest, run
as [B, L] with causal SDPA through the same modules. Lengths are heavy-tailed (log-normal), like
RL completions. Tokens/s counts real (non-pad) tokens only. Single process, CPU.

    python -m bench.trainer_packing [--quick]
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import emit, median, parse_args, timed
from services.kit.config.recipe import AlgorithmSection
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM, apply_rope, rope_cos_sin
from services.trainer.loss import StepNorm, policy_loss

BENCH = "trainer_packing"


def heavy_tailed_lengths(n: int, median_len: int, max_len: int, rng: np.random.Generator) -> list[int]:
    sigma = math.log(max_len / median_len) / 3.0
    return np.clip(rng.lognormal(math.log(median_len), sigma, n), 8, max_len).astype(int).tolist()


def make_rollouts(lengths: list[int], vocab: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for length in lengths:
        prompt = max(1, length // 4)
        mask = np.zeros(length, dtype=np.float32)
        mask[prompt:] = 1
        out.append(
            {
                "tokens": torch.from_numpy(rng.integers(0, vocab, length)),
                "mask": torch.from_numpy(mask),
                "adv": torch.from_numpy(mask * rng.standard_normal()),
                "behaviour": torch.from_numpy(mask * -2.0),
            }
        )
    return out


def pack_first_fit(rollouts: list[dict], budget: int) -> list[list[dict]]:
    bins: list[list[dict]] = []
    room: list[int] = []
    for r in sorted(rollouts, key=lambda r: -len(r["tokens"])):
        n = len(r["tokens"])
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(r)
                room[i] -= n
                break
        else:
            bins.append([r])
            room.append(budget - n)
    return bins


def packed_step(model, bins: list[list[dict]], norm: StepNorm, cfg: AlgorithmSection) -> float:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for seqs in bins:
        ids = torch.cat([s["tokens"] for s in seqs])
        pos = torch.cat([torch.arange(len(s["tokens"])) for s in seqs])
        cu = torch.tensor([0, *np.cumsum([len(s["tokens"]) for s in seqs]).tolist()])
        logp = token_logprobs(model(ids, pos, cu), ids, cu)
        behaviour, adv, mask = (torch.cat([s[k] for s in seqs]) for k in ("behaviour", "adv", "mask"))
        share, _ = policy_loss(logp, behaviour, adv, mask, cu, cfg, norm)
        share.backward()
        total += float(share.detach())
    return total


def _batched_forward(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] -> logits [B, L, V] through the same modules, with batched causal SDPA."""
    c = model.config
    b, length = ids.shape
    x = model.model.embed_tokens(ids)
    cos, sin = rope_cos_sin(torch.arange(length), c.head_dim, c.rope_theta, x.dtype)
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, length, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, length, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, length, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # Right padding: with a causal mask no real token ever sees a pad key.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, length, c.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


def padded_step(model, batches: list[list[dict]], norm: StepNorm, cfg: AlgorithmSection) -> float:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for seqs in batches:
        length = max(len(s["tokens"]) for s in seqs)

        def pad(key: str, value: float, dtype, seqs=seqs, length=length) -> torch.Tensor:
            return torch.stack(
                [F.pad(s[key].to(dtype), (0, length - len(s[key])), value=value) for s in seqs]
            )

        ids = pad("tokens", 0, torch.long)
        logits = _batched_forward(model, ids)
        flat_cu = torch.arange(0, len(seqs) * length + 1, length)
        logp = token_logprobs(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), flat_cu)
        share, _ = policy_loss(
            logp,
            pad("behaviour", 0.0, torch.float32).reshape(-1),
            pad("adv", 0.0, torch.float32).reshape(-1),
            pad("mask", 0.0, torch.float32).reshape(-1),
            flat_cu,
            cfg,
            norm,
        )
        share.backward()
        total += float(share.detach())
    return total


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    if args.quick:
        n, median_len, max_len, repeat = 64, 48, 1024, 2
    else:
        n, median_len, max_len, repeat = 128, 64, 1024, 3
    batch_size, budget = 8, max_len
    config = ModelConfig.tiny(
        hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4, head_dim=32
    )
    model = Qwen2ForCausalLM(config, seed=0)
    rng = np.random.default_rng(0)
    lengths = heavy_tailed_lengths(n, median_len, max_len, rng)
    rollouts = make_rollouts(lengths, config.vocab_size, rng)
    real_tokens = sum(lengths)
    norm = StepNorm(int(sum(float(r["mask"].sum()) for r in rollouts)), len(rollouts))
    cfg = AlgorithmSection()

    bins = pack_first_fit(rollouts, budget)
    batches = [rollouts[i : i + batch_size] for i in range(0, n, batch_size)]
    padded_tokens = sum(len(b) * max(len(s["tokens"]) for s in b) for b in batches)

    loss_packed = packed_step(model, bins, norm, cfg)
    loss_padded = padded_step(model, batches, norm, cfg)
    assert abs(loss_packed - loss_padded) < 1e-4, (loss_packed, loss_padded)  # the same objective

    packed_s = median(timed(lambda: packed_step(model, bins, norm, cfg), repeat=repeat, warmup=1))
    padded_s = median(timed(lambda: padded_step(model, batches, norm, cfg), repeat=repeat, warmup=1))
    packed_tps, padded_tps = real_tokens / packed_s, real_tokens / padded_s

    print(
        f"rollouts {n}, lengths median {int(np.median(lengths))} p99 {int(np.percentile(lengths, 99))} "
        f"max {max(lengths)}; real tokens {real_tokens}"
    )
    print(f"{'layout':<22}{'micro-batches':>14}{'computed tokens':>17}{'s/step':>9}{'tokens/s':>11}")
    print(
        f"{'packed (budget ' + str(budget) + ')':<22}{len(bins):>14}{real_tokens:>17}{packed_s:>9.3f}{packed_tps:>11.0f}"
    )
    print(
        f"{'pad-to-longest (B=' + str(batch_size) + ')':<22}{len(batches):>14}{padded_tokens:>17}"
        f"{padded_s:>9.3f}{padded_tps:>11.0f}"
    )
    print(f"same loss: packed {loss_packed:.6f} padded {loss_padded:.6f}")
    emit(BENCH, "packed_tokens_per_s", packed_tps, padded_tps, packed_tps / padded_tps, "tokens/s", ">= 1.5x")
    emit(BENCH, "tokens_per_s_ratio", packed_tps / padded_tps, 1.0, packed_tps / padded_tps, "x", ">= 1.5")


if __name__ == "__main__":
    main()
