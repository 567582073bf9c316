"""The inference-side Qwen2 (and Llama, Qwen3): one TP rank's shard of the weights, a slot KV cache, prefill and decode.

An `EngineModel` holds ONLY the tensors `layouts.rank_params(config, layout, rank)` lists (fused or
HF naming, in the layout's dtype), so a tp=2 deployment really holds its weights column/row-split
as vLLM would. Column-parallel projections (qkv, gate_up) need no communication; the row-parallel
outputs (o_proj, down_proj) are partial sums that the `all_reduce(tensor)` callback must sum in
place across the TP group (gloo in a Ray actor group; `tp_local.LocalTPGroup` in one process).
embed_tokens and lm_head are vocab-parallel (each rank holds `layout.vocab_rows`): a token's
embedding is looked up on the one rank holding its row (zeros elsewhere) and all-reduced; each
rank's logits over its rows are joined by the `all_gather` callback (or, without one, by an
all-reduce of a zero-padded [N, V] tensor), so every rank ends with the full logits.

The `KVCache` holds, per rank, keys/values of up to `max_slots` sequences of up to `max_len`
tokens. `prefill` appends tokens to a slot (start_pos = tokens already cached, so multi-turn
episodes reuse their prefix); `decode` advances many slots of different lengths by one token each.

Batch invariance: a sequence's logits do not depend on what else shares its batch, bit for bit, so
a seeded request samples the same tokens with the same log-probs however requests arrive (what makes
a synchronous run reproducible). CPU kernels pick their reduction order by shape: a matmul of 1-3
rows reduces differently from one of more, and attention sums keys in vector-width chunks whose tail
depends on the key count. So matmuls get at least `MIN_GEMM_ROWS` rows (zero rows added), attention
spans are whole `KEY_BLOCK`s (masked keys add exact zeros), and every prompt's attention is its own
call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, TargetParam, rank_params
from services.modeling.lora import LoraSpec
from services.modeling.qwen2 import apply_rope, rms_norm, rope_cos_sin

AllReduce = Callable[[Tensor], None]


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter this rank serves: its shard of the tensors (names from `rank_params` of the
    adapter config) and alpha / rank."""

    params: Mapping[str, Tensor]
    scaling: float


# The adapters of a forward pass: each with the rows (tokens) it applies to, None for all rows.
AdapterRows = Sequence[tuple[Adapter, Tensor | None]]
MIN_GEMM_ROWS = 8
KEY_BLOCK = 64
# all_gather(t) -> [tp, *t.shape]: every rank's t (all the same shape) stacked in rank order.
AllGather = Callable[[Tensor], Tensor]


class KVCache:
    """Per-rank key/value storage for `max_slots` sequences; slot bookkeeping lives here too."""

    def __init__(
        self,
        config: ModelConfig,
        layout: Layout,
        max_slots: int,
        max_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        layout.check(config)
        if max_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache: max_slots and max_len must be >= 1, got {max_slots}, {max_len}")
        if max_len > config.max_position_embeddings:
            raise ValueError(
                f"KVCache.max_len={max_len} exceeds max_position_embeddings={config.max_position_embeddings}"
            )
        self.max_slots, self.max_len = max_slots, max_len
        kv_heads = len(layout.kv_heads(config, 0))
        # Storage in whole key blocks, so every attention span can be one (see the module docstring).
        capacity = _round_up(max_len, KEY_BLOCK)
        shape = (config.num_hidden_layers, max_slots, kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        self.lengths = torch.zeros(max_slots, dtype=torch.long)
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"KVCache: all {self.max_slots} slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        if slot in self._free:
            raise ValueError(f"KVCache.free: slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def length(self, slot: int) -> int:
        self._check_slot(slot)
        return int(self.lengths[slot])

    def tokens_in_use(self) -> int:
        return int(self.lengths.sum())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"KVCache: slot {slot} outside [0, {self.max_slots})")


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear whose rows do not depend on how many rows come with them (see the module docstring)."""
    rows = x.shape[0]
    if rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, MIN_GEMM_ROWS - rows))
    return F.linear(padded, weight, bias)[:rows]


class EngineModel:
    """One TP rank of a Qwen2 for generation. Load weights with `load_shard` before use."""

    def __init__(
        self,
        config: ModelConfig,
        layout: Layout,
        rank: int = 0,
        all_reduce: AllReduce | None = None,
        device: str | torch.device = "cpu",
        all_gather: AllGather | None = None,
    ) -> None:
        layout.check_rank(config, rank)
        if layout.tp_size > 1 and all_reduce is None:
            raise ValueError(f"EngineModel: tp_size={layout.tp_size} needs an all_reduce callback")
        self.config, self.layout, self.rank, self.device = config, layout, rank, torch.device(device)
        self.all_reduce, self.all_gather = all_reduce, all_gather
        self.vocab = layout.vocab_rows(config, rank)
        self.vocab_per_rank = -(-config.vocab_size // layout.tp_size)
        self.specs: dict[str, TargetParam] = {p.name: p for p in rank_params(config, layout, rank)}
        self.q_local = len(layout.q_heads(config, rank))
        self.kv_local = len(layout.kv_heads(config, rank))
        self.i_local = config.intermediate_size // layout.tp_size
        self.params: dict[str, Tensor] = {}
        self.adapters: dict[str, Adapter] = {}

    @property
    def loaded(self) -> bool:
        return bool(self.params)

    def load_adapter(self, name: str, adapter_config: ModelConfig, state: Mapping[str, Tensor]) -> None:
        """Serve (or replace) LoRA adapter `name`: this rank's shard of `adapter_config`'s tensors
        (checked in full before anything changes). Requests then pick it by name."""
        spec = self.check_adapter(name, adapter_config)
        expected = {p.name: p for p in rank_params(adapter_config, self.layout, self.rank)}
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"load_adapter {name!r}: missing {missing[:4]}, unexpected {unexpected[:4]}")
        for key, param in expected.items():
            if tuple(state[key].shape) != param.shape:
                raise ValueError(
                    f"load_adapter {name!r}: {key} has shape {tuple(state[key].shape)}, expected {param.shape}"
                )
        params = {k: state[k].detach().to(self.device, self.layout.torch_dtype) for k in expected}
        self.adapters[name] = Adapter(params, spec.scaling)

    def check_adapter(self, name: str, adapter_config: ModelConfig) -> LoraSpec:
        spec = adapter_config.lora
        if spec is None or adapter_config.base != self.config:
            raise ValueError(f"load_adapter {name!r}: its config is not a LoRA adapter of this model")
        return spec

    def drop_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def _adapter_rows(
        self, adapters: Sequence[str | None] | None, rows_of: Callable[[int], Tensor]
    ) -> AdapterRows:
        """(adapter, rows) of a forward whose i-th input uses adapters[i] (rows_of(i): its rows)."""
        if not adapters or not any(adapters):
            return []
        unknown = sorted({a for a in adapters if a and a not in self.adapters})
        if unknown:
            raise ValueError(f"adapter: {unknown} not loaded on this replica")
        by_name: dict[str, list[Tensor]] = {}
        for i, name in enumerate(adapters):
            if name:
                by_name.setdefault(name, []).append(rows_of(i))
        return [(self.adapters[n], torch.cat(rows).to(self.device)) for n, rows in by_name.items()]

    @staticmethod
    def _lora(x: Tensor, out: Tensor, module: str, adapters: AdapterRows) -> Tensor:
        """`out` (the projection of x) plus each adapter's scaling * B(A(x)) on its rows (PEFT's order)."""
        for adapter, rows in adapters:
            a = adapter.params.get(module + ".lora_A.weight")
            if a is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = _linear(_linear(xs, a), adapter.params[module + ".lora_B.weight"]) * adapter.scaling
            out = out + delta if rows is None else out.index_add(0, rows, delta)
        return out

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        return KVCache(self.config, self.layout, max_slots, max_len, self.device)

    def load_shard(self, state: Mapping[str, Tensor], copy: bool = False) -> None:
        """Swap in a complete shard (names from rank_params). Everything is checked before anything changes,
        so a bad shard leaves the previous weights serving. Tensors are used as given unless copy=True."""
        expected = set(self.specs)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"load_shard (rank {self.rank}, {self.layout.naming} tp={self.layout.tp_size}): "
                f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
            )
        for name, spec in self.specs.items():
            t = state[name]
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"load_shard: {name} has shape {tuple(t.shape)}, expected {spec.shape}")
            if t.dtype != self.layout.torch_dtype:
                raise ValueError(
                    f"load_shard: {name} has dtype {t.dtype}, expected {self.layout.torch_dtype}"
                )
        new = {}
        for name in self.specs:
            t = state[name].detach().to(self.device)
            new[name] = t.clone() if copy else t
        if self.config.tie_word_embeddings:
            new["lm_head.weight"] = new["model.embed_tokens.weight"]
        self.params = new

    # --- forward pieces -------------------------------------------------------------------------

    def _reduce(self, partial: Tensor) -> Tensor:
        if self.layout.tp_size > 1:
            assert self.all_reduce is not None
            self.all_reduce(partial)
        return partial

    def _qkv(self, layer: int, x: Tensor, adapters: AdapterRows) -> tuple[Tensor, Tensor, Tensor]:
        p, d = self.params, self.config.head_dim
        pre = f"model.layers.{layer}.self_attn."
        if self.layout.naming == "fused":
            qkv = _linear(x, p[pre + "qkv_proj.weight"], p.get(pre + "qkv_proj.bias"))
            q, k, v = qkv.split([self.q_local * d, self.kv_local * d, self.kv_local * d], dim=-1)
        else:
            q, k, v = (_linear(x, p[f"{pre}{n}_proj.weight"], p.get(f"{pre}{n}_proj.bias")) for n in "qkv")
        if adapters:
            q, k, v = (
                self._lora(x, t, f"{pre}{n}_proj", adapters) for n, t in zip("qkv", (q, k, v), strict=True)
            )
        n = x.shape[0]
        return q.view(n, self.q_local, d), k.view(n, self.kv_local, d), v.view(n, self.kv_local, d)

    def _mlp(self, layer: int, x: Tensor, adapters: AdapterRows) -> Tensor:
        p = self.params
        pre = f"model.layers.{layer}.mlp."
        if self.layout.naming == "fused":
            gate, up = _linear(x, p[pre + "gate_up_proj.weight"]).split(self.i_local, dim=-1)
        else:
            gate, up = _linear(x, p[pre + "gate_proj.weight"]), _linear(x, p[pre + "up_proj.weight"])
        if adapters:
            gate = self._lora(x, gate, pre + "gate_proj", adapters)
            up = self._lora(x, up, pre + "up_proj", adapters)
        h = F.silu(gate) * up
        # Row-parallel: each rank's delta reads its input columns (its A shard); the partial sums
        # of base and delta are all-reduced together.
        return self._reduce(
            self._lora(h, _linear(h, p[pre + "down_proj.weight"]), pre + "down_proj", adapters)
        )

    def _run_layers(
        self, token_ids: Tensor, positions: Tensor, attend: Callable[..., Tensor], adapters: AdapterRows = ()
    ) -> Tensor:
        """Shared trunk: `attend(layer, q, k, v)` stores k/v and returns attention output [N, q_local, d]."""
        if not self.params:
            raise RuntimeError("EngineModel: no weights loaded (call load_shard first)")
        c, p = self.config, self.params
        x = self._embed(token_ids.to(self.device))
        cos, sin = rope_cos_sin(positions.to(self.device), c.head_dim, c.rope_theta, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads of [N, heads, d]
        for layer in range(c.num_hidden_layers):
            pre = f"model.layers.{layer}."
            h = rms_norm(x, p[pre + "input_layernorm.weight"], c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, adapters)
            if c.qk_norm:  # Qwen3: RMSNorm over head_dim of every head, before RoPE
                q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], c.rms_norm_eps)
                k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = attend(layer, q, k, v).reshape(x.shape[0], self.q_local * c.head_dim)
            o = _linear(attn, p[pre + "self_attn.o_proj.weight"])
            x = x + self._reduce(self._lora(attn, o, pre + "self_attn.o_proj", adapters) if adapters else o)
            x = x + self._mlp(
                layer, rms_norm(x, p[pre + "post_attention_layernorm.weight"], c.rms_norm_eps), adapters
            )
        return rms_norm(x, p["model.norm.weight"], c.rms_norm_eps)

    def _embed(self, ids: Tensor) -> Tensor:
        table = self.params["model.embed_tokens.weight"]
        if self.layout.tp_size == 1:
            return F.embedding(ids, table)
        # Each id is in exactly one rank's rows; the others contribute zeros, so the sum is exact.
        outside = (ids < self.vocab.start) | (ids >= self.vocab.stop)
        x = F.embedding((ids - self.vocab.start).masked_fill(outside, 0), table)
        return self._reduce(x.masked_fill(outside[:, None], 0))

    def _logits(self, hidden: Tensor) -> Tensor:
        local = _linear(hidden, self.params["lm_head.weight"]).float()
        if self.layout.tp_size == 1:
            return local
        n, vocab = hidden.shape[0], self.config.vocab_size
        if self.all_gather is None:
            full = torch.zeros(n, vocab, device=local.device)
            full[:, self.vocab.start : self.vocab.stop] = local
            return self._reduce(full)
        # Ranks hold ceil(V/tp) rows except maybe the last: pad so every rank sends the same shape.
        padded = F.pad(local, (0, self.vocab_per_rank - local.shape[1]))
        gathered = self.all_gather(padded)  # [tp, n, per]
        return gathered.permute(1, 0, 2).reshape(n, -1)[:, :vocab].contiguous()

    # --- public API -------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        cache: KVCache,
        slot: int,
        token_ids: Tensor,
        start_pos: int = 0,
        all_logits: bool = False,
        adapter: str | None = None,
    ) -> Tensor:
        """Append `token_ids` [L] to `slot` at positions start_pos.. and return float32 logits of the last
        position [V] (or of every new position [L, V] with all_logits). start_pos <= the slot's cached
        length: equal appends (multi-turn), smaller rewinds (drops the cached tail)."""
        return self.prefill_batch(cache, [slot], [token_ids], [start_pos], all_logits, [adapter])[0]

    def prefill_prompts(
        self,
        cache: KVCache,
        slots: Sequence[int],
        prompts: Sequence[list[int]],
        adapters: Sequence[str | None] | None = None,
    ) -> Tensor:
        """Fresh prompts (token lists) into `slots`; float32 logits of each one's last position [B, V].
        One tensor per distinct prompt object: the n samples of a request share theirs, so
        prefill_batch checks and hashes it once."""
        tensors: dict[int, Tensor] = {}
        for p in prompts:
            if id(p) not in tensors:
                tensors[id(p)] = torch.tensor(p, dtype=torch.long)
        ids = [tensors[id(p)] for p in prompts]
        return torch.stack(self.prefill_batch(cache, slots, ids, [0] * len(slots), adapters=adapters))

    @torch.no_grad()
    def prefill_batch(
        self,
        cache: KVCache,
        slots: Sequence[int],
        token_ids: Sequence[Tensor],
        start_positions: Sequence[int],
        all_logits: bool = False,
        adapters: Sequence[str | None] | None = None,
    ) -> list[Tensor]:
        """Prefill several slots in one pass: matmuls over all new tokens, attention slot by slot (each
        prompt's own call, so it does not depend on the others); a fresh prompt given for several slots (the n
        samples of a request) is computed once and its keys/values copied. `adapters[i]` names the
        LoRA adapter input i runs with (None: the base model)."""
        adapters = list(adapters) if adapters else [None] * len(slots)
        if not (len(slots) == len(token_ids) == len(start_positions)) or not slots:
            raise ValueError(
                "prefill: slots, token_ids and start_positions must be non-empty and equally long"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill: duplicate slots {list(slots)}")
        # Fresh prompts that repeat (the n samples of a GRPO group) are computed once; their other
        # slots get a copy of its keys/values: exact, and n times less prefill. The n samples of a
        # request share one ids tensor, so each distinct tensor is read and checked once.
        first_of: dict[tuple[str | None, tuple[int, ...]], int] = {}
        keys: dict[int, tuple[int, ...]] = {}
        source = []  # per input: index of the input whose computation it shares (itself if none)
        lengths = cache.lengths.tolist()
        for i, (slot, ids, start) in enumerate(zip(slots, token_ids, start_positions, strict=True)):
            cache._check_slot(slot)
            key = keys.get(id(ids))
            if key is None:
                if ids.dim() != 1 or ids.numel() == 0:
                    raise ValueError(f"prefill: token_ids for slot {slot} must be a non-empty 1-D tensor")
                self._check_ids(ids)
                key = keys[id(ids)] = tuple(ids.tolist())
            if not 0 <= start <= lengths[slot]:
                raise ValueError(
                    f"prefill: start_pos {start} for slot {slot} exceeds cached length {lengths[slot]}"
                )
            if start + len(key) > cache.max_len:
                raise ValueError(
                    f"prefill: slot {slot} would hold {start + len(key)} > max_len={cache.max_len}"
                )
            # Keys/values depend on the adapter: a prompt is shared only under the same one.
            source.append(first_of.setdefault((adapters[i], key), i) if start == 0 else i)
        computed = [i for i in range(len(slots)) if source[i] == i]
        segments = []  # (slot, start, offset in the flat batch, length) of each computed input
        offset = 0
        for i in computed:
            n = token_ids[i].numel()
            segments.append((slots[i], start_positions[i], offset, n))
            offset += n
        flat = torch.cat([token_ids[i].long() for i in computed])
        positions = torch.cat([torch.arange(s, s + n) for _, s, _, n in segments])
        rows = self._adapter_rows(
            [adapters[i] for i in computed],
            lambda j: torch.arange(segments[j][2], segments[j][2] + segments[j][3]),
        )
        hidden = self._run_layers(flat, positions, self._slot_attend(cache, segments), rows)
        for slot, start, _, n in segments:
            cache.lengths[slot] = start + n
        copies: dict[int, list[int]] = {}  # computed input -> the slots that share its keys/values
        for i, src in enumerate(source):
            if src != i:
                copies.setdefault(src, []).append(slots[i])
        for src, targets in copies.items():
            n, into = token_ids[src].numel(), torch.tensor(targets)
            cache.k[:, into, :, :n] = cache.k[:, slots[src] : slots[src] + 1, :, :n]
            cache.v[:, into, :, :n] = cache.v[:, slots[src] : slots[src] + 1, :, :n]
            cache.lengths[into] = n
        if all_logits:
            out = [self._logits(hidden[off : off + n]) for _, _, off, n in segments]
        else:
            last = torch.tensor([off + n - 1 for _, _, off, n in segments], device=hidden.device)
            out = list(self._logits(hidden[last]))
        by_input = dict(zip(computed, out, strict=True))
        return [by_input[src] for src in source]

    @staticmethod
    def _slot_attend(cache: KVCache, segments: list[tuple[int, int, int, int]]):
        """Attention slot by slot over each slot's cached prefix plus its new tokens."""

        device = cache.k.device
        masks = []  # per segment, the same in every layer: its causal mask over its key span
        for _, start, _, n in segments:
            span = _round_up(start + n, KEY_BLOCK)
            qpos = torch.arange(start, start + n, device=device)
            masks.append(torch.arange(span, device=device)[None, :] <= qpos[:, None])

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = torch.empty_like(q)
            for (slot, start, off, n), mask in zip(segments, masks, strict=True):
                ck, cv = cache.k[layer, slot], cache.v[layer, slot]  # [kv, max_len, d]
                ck[:, start : start + n] = k[off : off + n].transpose(0, 1)
                cv[:, start : start + n] = v[off : off + n].transpose(0, 1)
                span = mask.shape[1]
                keys, values = ck[:, :span], cv[:, :span]
                o = F.scaled_dot_product_attention(
                    q[off : off + n].transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
                )
                out[off : off + n] = o.transpose(0, 1)
            return out

        return attend

    @torch.no_grad()
    def decode(
        self,
        cache: KVCache,
        slots: Tensor,
        token_ids: Tensor,
        positions: Tensor,
        adapters: Sequence[str | None] | None = None,
    ) -> Tensor:
        """One token for each of B slots: token_ids[b] goes to positions[b] (normally the slot's cached
        length), under LoRA adapter adapters[b] (None: the base). Returns float32 logits [B, V] for
        the next token of each slot."""
        slots, token_ids, positions = slots.long().cpu(), token_ids.long(), positions.long().cpu()
        if not (slots.dim() == token_ids.dim() == positions.dim() == 1) or not (
            slots.numel() == token_ids.numel() == positions.numel() > 0
        ):
            raise ValueError(
                "decode: slots, token_ids and positions must be non-empty 1-D tensors of equal size"
            )
        if slots.unique().numel() != slots.numel():
            raise ValueError(f"decode: duplicate slots {slots.tolist()}")
        if bool((slots < 0).any() | (slots >= cache.max_slots).any()):
            raise ValueError(f"decode: slots {slots.tolist()} outside [0, {cache.max_slots})")
        if bool((positions < 0).any() | (positions > cache.lengths[slots]).any()):
            raise ValueError(
                f"decode: positions {positions.tolist()} must be within the cached lengths "
                f"{cache.lengths[slots].tolist()}"
            )
        if bool((positions >= cache.max_len).any()):
            raise ValueError(f"decode: positions {positions.tolist()} reach max_len={cache.max_len}")
        self._check_ids(token_ids)
        dev_slots, dev_pos = slots.to(cache.k.device), positions.to(cache.k.device)
        span = _round_up(int(positions.max()) + 1, KEY_BLOCK)
        visible = torch.arange(span, device=cache.k.device)[None, :] <= dev_pos[:, None]  # [B, span]
        group = self.q_local // self.kv_local
        scale = self.config.head_dim**-0.5

        # Slots handed out lowest first are usually one ascending run: read their keys as a view.
        first = int(slots[0])
        run = (
            slice(first, first + slots.numel())
            if bool((slots == torch.arange(first, first + slots.numel())).all())
            else None
        )

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            ck, cv = cache.k[layer], cache.v[layer]
            ck[dev_slots, :, dev_pos] = k
            cv[dev_slots, :, dev_pos] = v
            if run is not None:
                keys, values = ck[run, :, :span], cv[run, :, :span]  # [B, kv_heads, span, d]
            else:
                keys, values = ck[dev_slots, :, :span], cv[dev_slots, :, :span]
            # Plain matmuls rather than SDPA, whose CPU kernel reduces a row differently depending on
            # the batch and thread count. Query head j reads kv head j // group (GQA).
            b, d = q.shape[0], q.shape[-1]
            scores = torch.matmul(q.view(b, self.kv_local, group, d), keys.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, kv_heads, group, d]
            return out.reshape(b, self.q_local, d)

        rows = self._adapter_rows(adapters, lambda b: torch.tensor([b]))
        hidden = self._run_layers(token_ids, positions, attend, rows)
        cache.lengths[slots] = positions + 1
        return self._logits(hidden)

    def _check_ids(self, ids: Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {ids.tolist()[:16]}")
