"""Qwen2ForCausalLM in plain torch, with Hugging Face parameter names, on packed batches.

The trainer's policy on the fast path: Qwen2, Llama and Qwen3 (whose attention adds a per-head
RMSNorm on q and k, `ModelConfig.qk_norm`) share this code. A forward pass takes ONE packed batch: all sequences concatenated into
`input_ids[T]`, positions restarting per sequence in `position_ids[T]`, and the boundaries in
`cu_seqlens[S+1]`; attention is causal and block-diagonal, so no token sees another sequence.
Parameter names equal transformers' Qwen2ForCausalLM, so `state_dict()` is what weight-sync and
`save_pretrained` move around, and checkpoints load both ways. The math helpers (`rms_norm`,
`rope_cos_sin`, `apply_rope`) are shared with the inference engine model so both compute alike.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.modeling.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
# Parameter names of the RMSNorm weights (initialised to ones).
NORM_SUFFIXES = ("layernorm.weight", "q_norm.weight", "k_norm.weight")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers computes it: statistics in float32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [len(positions), head_dim] for rotate-half RoPE (computed in float32)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., T, head_dim] rotated by per-token cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def check_packed_inputs(input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor) -> None:
    total = input_ids.shape[0]
    if total == 0:
        raise ValueError("input_ids is empty: a packed batch needs at least one token")
    if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and position_ids must both be 1-D of the same length, got "
            f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at len(input_ids)={total}, got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, blocks: LengthBlocks) -> Tensor:
        c = self.config
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        group = c.num_attention_heads // c.num_key_value_heads
        if group > 1:
            # Query head j uses kv head j // group (transformers' repeat_kv).
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # Block-diagonal causal attention as one fused call per distinct sequence length: sequences
        # of one length stack into [n, heads, L, d]. Costs sum(L_i^2), not T^2, needs no [T, T] mask,
        # and a GRPO step (a few lengths, many sequences) makes a handful of calls, not one per sequence.
        # A block holding shared-prompt branches attends through its [L, L] segment mask instead.
        outs = []
        # index: [n, L] token positions of the n sequences of one length.
        for index, mask in zip(blocks.token_index, blocks.masks, strict=True):
            outs.append(
                F.scaled_dot_product_attention(
                    q[index].transpose(1, 2),
                    k[index].transpose(1, 2),
                    v[index].transpose(1, 2),
                    attn_mask=mask,
                    is_causal=mask is None,
                )
                .transpose(1, 2)
                .reshape(-1, c.num_attention_heads, c.head_dim)
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        if blocks.restore is not None:
            out = out.index_select(0, blocks.restore)
        return self.o_proj(out.reshape(t, c.q_size))


class LengthBlocks:
    """A packed batch's sequences grouped by length: per distinct length, the [n, L] token positions
    of its sequences, the attention mask of the block when it is not plain causal, and the
    permutation that puts the blocks' concatenated tokens back in order.

    `segments` [T] (optional) lays branches after a shared prefix (services/modeling/shared_prefix.py):
    segment 0 of a sequence is its prefix, and a token of segment k > 0 sees the prefix and the
    earlier tokens of segment k only, as if each branch were its own sequence starting with the prefix."""

    def __init__(self, cu_seqlens: Tensor, segments: Tensor | None = None) -> None:
        bounds = cu_seqlens.tolist()
        by_length: dict[int, list[int]] = {}
        for start, end in itertools.pairwise(bounds):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        device = cu_seqlens.device
        self.token_index = [
            torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)[None, :]
            for length, starts in sorted(by_length.items())
        ]
        order = torch.cat([index.reshape(-1) for index in self.token_index])
        in_order = bool((order[1:] > order[:-1]).all()) if order.numel() > 1 else True
        self.restore = None if in_order else torch.argsort(order)
        self.masks: list[Tensor | None] = [None] * len(self.token_index)
        if segments is not None:
            for i, index in enumerate(self.token_index):
                seg = segments[index]  # [n, L]
                if bool(seg.any()):
                    length = index.shape[1]
                    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
                    visible = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0)
                    self.masks[i] = (visible & causal)[:, None]  # [n, 1, L, L], broadcast over heads


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, blocks: LengthBlocks) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, blocks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, segments: Tensor | None = None
    ) -> Tensor:
        c = self.config
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads of [T, heads, d]
        blocks = LengthBlocks(cu_seqlens, segments)
        for layer in self.layers:
            x = layer(x, cos, sin, blocks)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 causal LM. `Qwen2ForCausalLM(config, seed=0)` builds it with deterministic weights;
    `seed=None` leaves torch's default initialisation (use it before loading a state dict)."""

    def __init__(self, config: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if seed is not None:
            self.init_weights(seed)

    @classmethod
    def from_config(
        cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> Qwen2ForCausalLM:
        return cls(config, seed=seed).to(dtype)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic init independent of the global RNG: N(0, std) matrices, zero biases, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():  # a tied weight appears once
            if p.is_meta:
                continue
            if name.endswith(NORM_SUFFIXES) or name == "model.norm.weight":
                value = torch.ones(p.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value.to(p.dtype))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        logits_at: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """Logits [T, V] of a packed batch, or only at the rows `logits_at` ([R] -> [R, V]): the
        vocabulary projection of a prompt token that predicts nothing trained is wasted work.
        Omitted position_ids/cu_seqlens mean one sequence; `segments` see LengthBlocks."""
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, segments)
        return self.lm_head(hidden if logits_at is None else hidden.index_select(0, logits_at))

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """Final normed hidden states [T, H] (apply `lm_head` yourself to chunk the vocab projection)."""
        total = input_ids.shape[0]
        if position_ids is None:
            position_ids = torch.arange(total, device=input_ids.device)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, total], device=input_ids.device)
        check_packed_inputs(input_ids, position_ids, cu_seqlens)
        if segments is not None and segments.shape != input_ids.shape:
            raise ValueError(f"segments must be [T] like input_ids, got {tuple(segments.shape)}")
        return self.model(input_ids, position_ids, cu_seqlens.to(input_ids.device), segments)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """State dict as stored on disk: a tied lm_head appears once (as embed_tokens), like HF."""
        sd = self.state_dict()
        if self.config.tie_word_embeddings:
            sd.pop(LM_HEAD, None)
        return sd

    def save_pretrained(self, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors, loadable by transformers and vLLM."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.hf_state_dict().items()}
        stored = next(iter(sd.values())).dtype
        hf = self.config.to_hf_dict()
        hf["torch_dtype"] = hf["dtype"] = str(stored).removeprefix("torch.")
        (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
        save_file(sd, str(path / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str | None = None
    ) -> Qwen2ForCausalLM:
        """Load a HF-format directory (single or sharded safetensors); strict about parameter names."""
        path = Path(directory)
        config = ModelConfig.from_hf_dict(json.loads((path / CONFIG_FILE).read_text()), "fast")
        sd = load_safetensors_dir(path)
        with torch.device("meta"):
            model = cls(config, seed=None)
        model.load_hf_state_dict(sd, assign=True)
        if dtype is not None or device is not None:
            model = model.to(device=device, dtype=dtype)
        return model

    def load_hf_state_dict(self, sd: dict[str, Tensor], assign: bool = False) -> None:
        """Load HF-named weights; a tied lm_head may be absent (or present and ignored)."""
        sd = dict(sd)
        if self.config.tie_word_embeddings:
            sd.pop(LM_HEAD, None)
        expected = set(self.hf_state_dict().keys())
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        self.load_state_dict(sd, strict=False, assign=assign)
        self.tie_weights()


def load_safetensors_dir(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if (path / WEIGHTS_FILE).is_file():
        return load_file(str(path / WEIGHTS_FILE))
    index_file = path / WEIGHTS_INDEX_FILE
    if not index_file.is_file():
        raise FileNotFoundError(f"{path}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
    sd: dict[str, Tensor] = {}
    for shard in sorted(set(json.loads(index_file.read_text())["weight_map"].values())):
        sd.update(load_file(str(path / shard)))
    return sd
