"""Tensor-parallel layouts and the reshard plan data: which block of which HF tensor lands where.

A `Layout` says how an inference deployment holds its weights: tensor-parallel degree, parameter
naming ("hf": q_proj/k_proj/..., "fused": vLLM's qkv_proj/gate_up_proj) and dtype.
`rank_params(config, layout, rank)` lists, for one TP rank, every parameter it holds: name, shape,
dtype and the `Piece`s composing it. A Piece copies a rectangular box of a SOURCE tensor (a full
Hugging Face parameter, as the trainer's state dict names it) into a box of the TARGET tensor, with
equal extents in every dimension. Everything else is derived from these pieces: `shard_state_dict`
builds a rank's tensors only by applying them, weight-sync clips them to the rows each trainer
shard holds (`Piece.clip_source_rows`), so plan and reference agree by construction.

Fused semantics (as vLLM lays weights out): rank r's qkv_proj is [q heads of r; kv heads of r;
v heads of r] (not an even split of the fused tensor); when tp > num_key_value_heads each kv head
is replicated and rank r holds kv head r * num_kv_heads // tp; gate_up_proj is [gate_r; up_r];
o_proj and down_proj are row-parallel (split along their input dimension, dim 1).

In both namings embed_tokens and lm_head are vocab-parallel (vLLM's VocabParallelEmbedding /
ParallelLMHead): rank r holds vocabulary rows `Layout.vocab_rows` = [r * ceil(V/tp),
min(V, (r+1) * ceil(V/tp))), so the last rank may hold fewer. The engine looks tokens up in its
rows and all-reduces (every token is found on exactly one rank) and gathers each rank's logits
along the vocabulary. (vLLM first pads V to a multiple of 64 and splits the padded rows, so its
boundaries equal these only when ceil(V/tp) is a multiple of 64/tp's share; the vLLM weight
backend checks each rank's first row against vLLM's shard before loading, see
services/inference_router/engine/vllm_handoff.py.)
A tied lm_head is not a target parameter at all (the receiver ties it to its own embed_tokens
rows), so it is never sent twice. Only the RMSNorm weights (Qwen3's per-head q_norm/k_norm among
them) are replicated on every rank (and the
kv heads when tp > num_key_value_heads): a tp>1 deployment receives the model once plus those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.modeling.config import ModelConfig

NAMINGS = ("hf", "fused")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Per-dimension half-open ranges [start, stop).
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    tp_size: int = 1
    naming: str = "hf"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"Layout.tp_size: must be an integer >= 1, got {self.tp_size!r}")
        if self.naming not in NAMINGS:
            raise ValueError(f"Layout.naming: must be one of {NAMINGS}, got {self.naming!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Layout.dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError when this layout cannot shard `config`."""
        if config.generic:
            if self.tp_size != 1 or self.naming != "hf":
                raise ValueError(
                    f"Layout: a {config.model_type!r} model runs on the generic path (transformers' code), "
                    f"which serves tp=1 with the checkpoint's names, not tp={self.tp_size} {self.naming}"
                )
            return
        tp, heads, kv = self.tp_size, config.num_attention_heads, config.num_key_value_heads
        if heads % tp:
            raise ValueError(f"Layout.tp_size={tp} must divide num_attention_heads={heads}")
        if config.intermediate_size % tp:
            raise ValueError(f"Layout.tp_size={tp} must divide intermediate_size={config.intermediate_size}")
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise ValueError(
                f"Layout.tp_size={tp} and num_key_value_heads={kv}: one must divide the other "
                "(kv heads are split when tp <= kv heads, replicated when tp > kv heads)"
            )
        vocab = config.vocab_size
        if len(self.vocab_rows(config, tp - 1)) < 1:
            raise ValueError(
                f"Layout.tp_size={tp} leaves some rank no vocabulary rows of vocab_size={vocab} "
                f"(embed_tokens/lm_head are split in blocks of ceil({vocab}/{tp}) rows)"
            )

    def check_rank(self, config: ModelConfig, rank: int) -> None:
        self.check(config)
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is outside [0, tp_size={self.tp_size})")

    def q_heads(self, config: ModelConfig, rank: int) -> range:
        per = config.num_attention_heads // self.tp_size
        return range(rank * per, (rank + 1) * per)

    def kv_heads(self, config: ModelConfig, rank: int) -> range:
        kv, tp = config.num_key_value_heads, self.tp_size
        if tp <= kv:
            per = kv // tp
            return range(rank * per, (rank + 1) * per)
        head = rank * kv // tp
        return range(head, head + 1)

    def vocab_rows(self, config: ModelConfig, rank: int) -> range:
        """Rows of embed_tokens / lm_head (token ids) rank `rank` holds; the last rank may hold fewer."""
        vocab, tp = config.vocab_size, self.tp_size
        per = -(-vocab // tp)
        return range(min(vocab, rank * per), min(vocab, (rank + 1) * per))

    def to_dict(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "naming": self.naming, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layout:
        return cls(
            tp_size=int(d.get("tp_size", 1)), naming=d.get("naming", "hf"), dtype=d.get("dtype", "float32")
        )


def _extent(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


@dataclass(frozen=True)
class Piece:
    """Copy source[source_box] into target[target_box]; both boxes have the same extents."""

    source: str
    source_box: Box
    target_box: Box

    def __post_init__(self) -> None:
        if len(self.source_box) != len(self.target_box) or _extent(self.source_box) != _extent(
            self.target_box
        ):
            raise ValueError(
                f"Piece {self.source}: box extents differ: {self.source_box} vs {self.target_box}"
            )
        if any(stop < start or start < 0 for start, stop in (*self.source_box, *self.target_box)):
            raise ValueError(f"Piece {self.source}: malformed box {self.source_box} -> {self.target_box}")

    @property
    def shape(self) -> tuple[int, ...]:
        return _extent(self.source_box)

    @property
    def numel(self) -> int:
        n = 1
        for e in self.shape:
            n *= e
        return n

    def source_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.source_box)

    def target_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.target_box)

    def clip_source_rows(self, row_start: int, row_stop: int) -> Piece | None:
        """The part of this piece whose source rows (dim 0) lie in [row_start, row_stop), or None.

        This is how a dim-0 (FSDP) shard holding rows [row_start, row_stop) of the source finds what it
        contributes; the source box stays in FULL-tensor coordinates (subtract row_start to index the shard).
        """
        (s0, s1), *rest_src = self.source_box
        (t0, _), *rest_dst = self.target_box
        lo, hi = max(s0, row_start), min(s1, row_stop)
        if lo >= hi:
            return None
        return Piece(self.source, ((lo, hi), *rest_src), ((t0 + lo - s0, t0 + hi - s0), *rest_dst))


@dataclass(frozen=True)
class TargetParam:
    """One parameter a target rank holds, and the pieces that compose it (they tile it exactly)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for e in self.shape:
            n *= e
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def hf_params(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The source parameters (HF names and shapes) in HF state-dict order; a tied lm_head is omitted.
    An adapter config's are the adapter's tensors (services/modeling/lora.py)."""
    if config.lora is not None:
        from services.modeling.lora import adapter_params

        return adapter_params(hf_params(config.base), config.lora)
    if config.generic:
        from services.modeling.generic import parameter_shapes

        return parameter_shapes(config)
    c = config
    h, i = c.hidden_size, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        out[p + "self_attn.q_proj.weight"] = (c.q_size, h)
        if c.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (c.q_size,)
        out[p + "self_attn.k_proj.weight"] = (c.kv_size, h)
        if c.attention_bias:
            out[p + "self_attn.k_proj.bias"] = (c.kv_size,)
        out[p + "self_attn.v_proj.weight"] = (c.kv_size, h)
        if c.attention_bias:
            out[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        out[p + "self_attn.o_proj.weight"] = (h, c.q_size)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out


class _Builder:
    """Stacks row blocks of source tensors into one target parameter."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> None:
        self.shapes, self.dtype = shapes, dtype

    def replicated(self, name: str) -> TargetParam:
        box = tuple((0, e) for e in self.shapes[name])
        return TargetParam(name, self.shapes[name], self.dtype, (Piece(name, box, box),))

    def stacked_rows(self, name: str, blocks: Sequence[tuple[str, int, int]]) -> TargetParam:
        """Target = concat over dim 0 of source[start:stop] for each (source, start, stop)."""
        pieces, row = [], 0
        for source, start, stop in blocks:
            rest = tuple((0, e) for e in self.shapes[source][1:])
            pieces.append(Piece(source, ((start, stop), *rest), ((row, row + stop - start), *rest)))
            row += stop - start
        shape = (row, *self.shapes[blocks[0][0]][1:])
        return TargetParam(name, shape, self.dtype, tuple(pieces))

    def column_slice(self, name: str, source: str, start: int, stop: int) -> TargetParam:
        rows = self.shapes[source][0]
        piece = Piece(source, ((0, rows), (start, stop)), ((0, rows), (0, stop - start)))
        return TargetParam(name, (rows, stop - start), self.dtype, (piece,))


def rank_params(config: ModelConfig, layout: Layout, rank: int) -> list[TargetParam]:
    """Every parameter TP rank `rank` of `layout` holds, in a deterministic (HF-like) order."""
    layout.check_rank(config, rank)
    c, d = config, config.head_dim
    shapes = hf_params(c)
    b = _Builder(shapes, layout.dtype)
    if c.generic:  # tp=1: every tensor whole, under the checkpoint's name
        return [b.replicated(name) for name in shapes]
    if c.lora is not None:
        return _adapter_rank_params(b, c, layout, rank)
    qh, kvh = layout.q_heads(c, rank), layout.kv_heads(c, rank)
    q_rows = (qh.start * d, qh.stop * d)
    kv_rows = (kvh.start * d, kvh.stop * d)
    i_per = c.intermediate_size // layout.tp_size
    i_rows = (rank * i_per, (rank + 1) * i_per)
    fused = layout.naming == "fused"
    kinds = ("weight", "bias") if c.attention_bias else ("weight",)

    vocab = layout.vocab_rows(c, rank)
    vocab_rows = (vocab.start, vocab.stop)
    out = [b.stacked_rows("model.embed_tokens.weight", [("model.embed_tokens.weight", *vocab_rows)])]
    for layer in range(c.num_hidden_layers):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        if fused:
            for kind in kinds:
                q, k, v = (f"{attn}{n}_proj.{kind}" for n in "qkv")
                out.append(
                    b.stacked_rows(f"{attn}qkv_proj.{kind}", [(q, *q_rows), (k, *kv_rows), (v, *kv_rows)])
                )
        else:
            for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                for kind in kinds:
                    name = f"{attn}{n}_proj.{kind}"
                    out.append(b.stacked_rows(name, [(name, *rows)]))
        out.append(b.column_slice(f"{attn}o_proj.weight", f"{attn}o_proj.weight", *q_rows))
        if c.qk_norm:  # per head, so every rank holds the whole [head_dim] weight
            out.append(b.replicated(f"{attn}q_norm.weight"))
            out.append(b.replicated(f"{attn}k_norm.weight"))
        gate, up = f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"
        if fused:
            out.append(b.stacked_rows(f"{mlp}gate_up_proj.weight", [(gate, *i_rows), (up, *i_rows)]))
        else:
            out.append(b.stacked_rows(gate, [(gate, *i_rows)]))
            out.append(b.stacked_rows(up, [(up, *i_rows)]))
        out.append(b.column_slice(f"{mlp}down_proj.weight", f"{mlp}down_proj.weight", *i_rows))
        out.append(b.replicated(f"model.layers.{layer}.input_layernorm.weight"))
        out.append(b.replicated(f"model.layers.{layer}.post_attention_layernorm.weight"))
    out.append(b.replicated("model.norm.weight"))
    if not c.tie_word_embeddings:
        out.append(b.stacked_rows("lm_head.weight", [("lm_head.weight", *vocab_rows)]))
    return out


def _adapter_rank_params(b: _Builder, config: ModelConfig, layout: Layout, rank: int) -> list[TargetParam]:
    """A LoRA adapter split as its base layers are: a column-parallel projection's B keeps the rows
    of the outputs this rank computes (A whole), a row-parallel one's A keeps the columns of the
    inputs this rank holds (B whole), so each rank's low-rank update lands on its own shard."""
    c, d = config, config.head_dim
    qh, kvh = layout.q_heads(c, rank), layout.kv_heads(c, rank)
    i_per = c.intermediate_size // layout.tp_size
    rows = {
        "q_proj": (qh.start * d, qh.stop * d),
        "k_proj": (kvh.start * d, kvh.stop * d),
        "v_proj": (kvh.start * d, kvh.stop * d),
        "gate_proj": (rank * i_per, (rank + 1) * i_per),
        "up_proj": (rank * i_per, (rank + 1) * i_per),
    }
    columns = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
    out = []
    for name in b.shapes:
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[: -len(".lora_A.weight")]
        a, bw, proj = name, f"{module}.lora_B.weight", module.rpartition(".")[2]
        if proj in rows:
            out += [b.replicated(a), b.stacked_rows(bw, [(bw, *rows[proj])])]
        else:
            out += [b.column_slice(a, a, *columns[proj]), b.replicated(bw)]
    return out


def apply_piece(target: Tensor, piece: Piece, source: Tensor) -> None:
    """target[piece.target_box] = source[piece.source_box] (source is the FULL source tensor)."""
    target[piece.target_index()] = source[piece.source_index()].to(target.dtype)


def shard_state_dict(
    full_sd: Mapping[str, Tensor], config: ModelConfig, layout: Layout, rank: int
) -> dict[str, Tensor]:
    """The tensors TP rank `rank` holds, built only by applying `rank_params` pieces to HF weights."""
    shapes = hf_params(config)
    out: dict[str, Tensor] = {}
    for param in rank_params(config, layout, rank):
        target = torch.empty(param.shape, dtype=layout.torch_dtype)
        for piece in param.pieces:
            if piece.source not in full_sd:
                raise KeyError(f"shard_state_dict: source parameter {piece.source!r} is missing")
            source = full_sd[piece.source]
            if tuple(source.shape) != shapes[piece.source]:
                raise ValueError(
                    f"shard_state_dict: {piece.source} has shape {tuple(source.shape)}, "
                    f"expected {shapes[piece.source]}"
                )
            apply_piece(target, piece, source.detach())
        out[param.name] = target
    return out


def unshard_state_dict(
    shards: Sequence[Mapping[str, Tensor]], config: ModelConfig, layout: Layout
) -> dict[str, Tensor]:
    """Inverse of shard_state_dict over all ranks (replicated blocks, the norms and kv heads when
    tp > num_key_value_heads, are taken from the last rank)."""
    if len(shards) != layout.tp_size:
        raise ValueError(f"unshard_state_dict: need {layout.tp_size} rank shards, got {len(shards)}")
    full = {name: torch.empty(shape, dtype=layout.torch_dtype) for name, shape in hf_params(config).items()}
    for rank, shard in enumerate(shards):
        for param in rank_params(config, layout, rank):
            for piece in param.pieces:
                full[piece.source][piece.source_index()] = shard[param.name][piece.target_index()]
    return full
