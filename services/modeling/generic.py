"""The generic path: any transformers causal LM, run by transformers' own modeling code.

A model whose architecture or features looprl's fast path does not implement (a Gemma, a Mistral, a
Qwen2 with sliding windows, ...) is trained and served through this module, slower but correct:

- `GenericCausalLM` (trainer) wraps `AutoModelForCausalLM.from_config` and takes looprl's packed
  batches: positions restart per sequence (`position_ids`, which place RoPE) and attention is a
  block-diagonal causal mask built from `cu_seqlens` (plus the shared-prompt `segments` of
  services/modeling/shared_prefix.py), handed to transformers as a ready 4-D mask. The wrapper's
  own children are the transformers model's (`model`, `lm_head`), so parameter names are exactly
  the checkpoint's, and weight-sync, checkpoints and `save_pretrained` move them as they are.
- `parameter_shapes` lists those names and shapes (a model built on the meta device), which is
  what weight-sync plans a version of a generic model by: tp=1, every tensor whole.
- `GenericEngineModel` (CPU engine) holds one transformers KV cache (`DynamicCache`) per slot:
  prefill appends to a slot's cache (or rewinds it), and decode advances each slot by one token,
  one forward per slot, so a sequence's logits never depend on what shares its batch.

transformers is imported only here, and only when a generic model is built.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from services.modeling.config import ModelConfig

CONFIG_FILE = "config.json"


def hf_config_object(config: ModelConfig, attn_implementation: str = "sdpa") -> Any:
    """The transformers config of a generic ModelConfig (ValueError naming an unknown model_type)."""
    from transformers import AutoConfig

    d = config.hf_config
    try:
        hf = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"config.json model_type: transformers has no model {d['model_type']!r} ({exc})"
        ) from None
    hf._attn_implementation = attn_implementation
    return hf


def _build_hf_model(config: ModelConfig, seed: int | None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    hf_config = hf_config_object(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)  # transformers' own init, seeded
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        except ValueError as exc:
            raise ValueError(
                f"config.json model_type: {config.model_type!r} is not a causal LM ({exc})"
            ) from None
    return model


@functools.lru_cache(maxsize=16)
def _shapes(hf_config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = ModelConfig.generic_from_hf_dict(json.loads(hf_config_json))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_object(config))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The generic model's parameters (checkpoint names, a tied lm_head once) and their shapes."""
    return dict(_shapes(config.hf_config_json))


def block_mask(cu_seqlens: Tensor, segments: Tensor | None, total: int, device: torch.device) -> Tensor:
    """[1, 1, T, T] bool: token i sees token j when both are in one sequence and j <= i (and, with
    segments, j is in i's branch or in the prefix all branches share)."""
    seq = torch.zeros(total, dtype=torch.long, device=device)
    starts = cu_seqlens[1:-1].to(device)
    seq[starts[starts < total]] = 1
    seq = seq.cumsum(0)
    visible = (seq[:, None] == seq[None, :]) & torch.ones(
        total, total, dtype=torch.bool, device=device
    ).tril()
    if segments is not None:
        seg = segments.to(device)
        visible &= (seg[:, None] == seg[None, :]) | (seg[None, :] == 0)
    return visible[None, None]


class GenericCausalLM(nn.Module):
    """A transformers causal LM behind the interface of services/modeling/qwen2.Qwen2ForCausalLM."""

    hf: Any  # the transformers model (set around nn.Module: its children are ours, not it)

    def __init__(self, config: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        if not config.generic:
            raise ValueError("GenericCausalLM: config is for the fast path (ModelConfig.generic is False)")
        self.config = config
        hf = _build_hf_model(config, seed)
        object.__setattr__(self, "hf", hf)  # not a child: its children are ours, names unprefixed
        for name, child in hf.named_children():
            self.add_module(name, child)

    @classmethod
    def from_config(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
        return cls(config, seed=seed).to(dtype)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """transformers' own initialisation with a seeded generator (`std` is its initializer_range)."""
        self.hf.config.initializer_range = std
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for module in self.hf.modules():
                self.hf._init_weights(module)
        self.hf.tie_weights()

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        logits_at: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """Logits [T, V] of a packed batch (or only at rows `logits_at`), as Qwen2ForCausalLM.forward."""
        from services.modeling.qwen2 import check_packed_inputs

        total = input_ids.shape[0]
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(total, device=device)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, total], device=device)
        check_packed_inputs(input_ids, position_ids, cu_seqlens)
        if segments is not None and segments.shape != input_ids.shape:
            raise ValueError(f"segments must be [T] like input_ids, got {tuple(segments.shape)}")
        out = self.hf(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=block_mask(cu_seqlens, segments, total, device),
            logits_to_keep=logits_at if logits_at is not None else 0,
            use_cache=False,
        )
        return out.logits[0]

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Parameters by checkpoint name, a tied lm_head once (as `named_parameters` lists them)."""
        return {name: p for name, p in self.named_parameters()}

    def load_hf_state_dict(self, sd: Mapping[str, Tensor], assign: bool = False) -> None:
        expected = set(parameter_shapes(self.config))
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected - {"lm_head.weight"})
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        self.load_state_dict(dict(sd), strict=False, assign=assign)
        self.hf.tie_weights()

    def save_pretrained(self, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        """transformers' own save_pretrained: config.json + model.safetensors."""
        model = self.hf if dtype is None else copy.deepcopy(self.hf).to(dtype)
        model.save_pretrained(str(directory))

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str | None = None
    ) -> GenericCausalLM:
        from services.modeling.qwen2 import load_safetensors_dir

        path = Path(directory)
        config = ModelConfig.from_hf_dict(json.loads((path / CONFIG_FILE).read_text()), "generic")
        model = cls(config, seed=0)
        model.load_hf_state_dict(load_safetensors_dir(path))
        if dtype is not None or device is not None:
            model = model.to(device=device, dtype=dtype)
        return model


class GenericEngineModel:
    """A generic model for generation: weights, a KV cache per slot, prefill and per-slot decode."""

    def __init__(self, config: ModelConfig, max_slots: int, max_len: int, dtype: torch.dtype = torch.float32):
        if max_slots < 1 or max_len < 1:
            raise ValueError(
                f"GenericEngineModel: max_slots and max_len must be >= 1, got {max_slots}, {max_len}"
            )
        self.config, self.max_slots, self.max_len, self.dtype = config, max_slots, max_len, dtype
        self.model: GenericCausalLM | None = None
        self.caches: list[Any] = [None] * max_slots
        self.lengths = [0] * max_slots

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def params(self) -> dict[str, Tensor]:
        """A copy of the weights served (the model holds its own: a caller may reuse this one)."""
        assert self.model is not None
        return {k: v.detach().clone() for k, v in self.model.hf_state_dict().items()}

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Swap in complete weights (checked before anything changes); the caches stay valid for
        sequences in flight, as they do on the fast path (their later tokens use the new weights)."""
        shapes = parameter_shapes(self.config)
        for name, shape in shapes.items():
            if name not in state:
                raise ValueError(f"load: missing {name}")
            if tuple(state[name].shape) != shape:
                raise ValueError(f"load: {name} has shape {tuple(state[name].shape)}, expected {shape}")
        if self.model is None:
            self.model = GenericCausalLM(self.config, seed=0).to(self.dtype).eval()
        self.model.load_hf_state_dict({k: v.to(self.dtype) for k, v in state.items() if k in shapes})

    def _forward(self, slot: int, ids: Tensor, start: int) -> Tensor:
        from transformers import DynamicCache

        assert self.model is not None
        cache = self.caches[slot]
        if cache is None or start == 0:
            cache = DynamicCache(config=self.model.hf.config)
        elif start < cache.get_seq_length():
            cache.crop(
                start - cache.get_seq_length()
            )  # a rewind: drop the cached tail (negative: tokens to remove)
        positions = torch.arange(start, start + ids.numel())[None]
        out = self.model.hf(
            input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=True
        )
        self.caches[slot], self.lengths[slot] = out.past_key_values, start + ids.numel()
        return out.logits[0].float()

    def _check(self, slot: int, ids: Tensor, start: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.max_slots})")
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prefill: token_ids for slot {slot} must be a non-empty 1-D tensor")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {ids.tolist()[:16]}")
        if not 0 <= start <= self.lengths[slot]:
            raise ValueError(
                f"prefill: start_pos {start} for slot {slot} exceeds cached length {self.lengths[slot]}"
            )
        if start + ids.numel() > self.max_len:
            raise ValueError(
                f"prefill: slot {slot} would hold {start + ids.numel()} > max_len={self.max_len}"
            )

    @torch.no_grad()
    def prefill(self, slot: int, ids: Tensor, start: int = 0, all_logits: bool = False) -> Tensor:
        """Append `ids` to `slot` at positions start..; float32 logits of the last position [V] (or
        of every new one [L, V])."""
        if not self.loaded:
            raise RuntimeError("GenericEngineModel: no weights loaded")
        self._check(slot, ids, start)
        logits = self._forward(slot, ids.long(), start)
        return logits if all_logits else logits[-1]

    @torch.no_grad()
    def prefill_prompts(self, slots: Sequence[int], prompts: Sequence[list[int]]) -> Tensor:
        """Fresh prompts into `slots`; logits of each last position [B, V]. A prompt given for several
        slots (the n samples of a request) is computed once and its cache copied."""
        done: dict[int, tuple[int, Tensor]] = {}
        out = []
        for slot, prompt in zip(slots, prompts, strict=True):
            first = done.get(id(prompt))
            if first is None:
                logits = self.prefill(slot, torch.tensor(prompt, dtype=torch.long))
                done[id(prompt)] = (slot, logits)
            else:
                self.caches[slot] = copy.deepcopy(self.caches[first[0]])
                self.lengths[slot] = self.lengths[first[0]]
                logits = first[1]
            out.append(logits)
        return torch.stack(out)

    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> Tensor:
        """One token per slot at `positions` (its cached length); next-token logits [B, V]."""
        if not self.loaded:
            raise RuntimeError("GenericEngineModel: no weights loaded")
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode: duplicate slots {list(slots)}")
        out = []
        for slot, token, pos in zip(slots, tokens, positions, strict=True):
            ids = torch.tensor([token], dtype=torch.long)
            self._check(slot, ids, pos)
            out.append(self._forward(slot, ids, pos)[-1])
        return torch.stack(out)

    def free(self, slot: int) -> None:
        self.caches[slot], self.lengths[slot] = None, 0
