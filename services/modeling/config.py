"""ModelConfig: the architecture hyper-parameters of a Qwen2-style decoder, and its HF config.json form.

One dataclass that trainer, engines and weight-sync share. It round-trips through the Hugging Face
`config.json` dictionary, so a checkpoint written here loads in transformers/vLLM and a real
checkpoint's config loads here. The fast path (services/modeling/qwen2.py, engine_model.py,
layouts.py) implements three families with the same parameter names: Qwen2 (`model_type: "qwen2"`,
q/k/v biases), Llama (`"llama"`, no biases) and Qwen3 (`"qwen3"`: no biases by default, and a
per-head RMSNorm on q and k before RoPE, `q_norm`/`k_norm`). Any other causal LM takes the generic
path (services/modeling/generic.py), which runs transformers' own modeling code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from services.modeling.lora import LoraSpec

# Keys of a HF config.json this code understands; everything else is ignored on load.
_SUPPORTED_MODEL_TYPES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FAST_MODEL_TYPES = tuple(_SUPPORTED_MODEL_TYPES)
# Which code runs a model: "fast" (looprl's own, tensor-parallel layouts), "generic" (transformers'
# modeling code, tp=1), "auto" (fast when it implements the checkpoint's architecture and features).
Implementation = Literal["auto", "fast", "generic"]
# Key of the config.json a trainer pushes that says the generic path runs it (never exported).
IMPLEMENTATION_KEY = "looprl_implementation"
# Key of the config.json a LoRA run's trainer pushes: its versions are the adapter's tensors only.
LORA_KEY = "looprl_lora"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 101
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    # Qwen2 has biases on q/k/v; Llama does not, Qwen3 only when its config says so.
    attention_bias: bool = True
    model_type: str = "qwen2"
    # Qwen3: RMSNorm over head_dim of every query and key head (weights q_norm/k_norm [head_dim]).
    qk_norm: bool = False
    # The generic path (services/modeling/generic.py): transformers' own code runs the model, built
    # from hf_config_json (its whole config.json); the fields above are read from it for sizes.
    generic: bool = False
    hf_config_json: str = ""
    # A LoRA adapter of this model (services/modeling/lora.py): rank 0 is the model's own weights;
    # otherwise the parameters (layouts.hf_params, what weight-sync moves) are the adapter's tensors.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank:
            self.lora  # noqa: B018 - validates rank and targets
        if self.generic:
            self._check_generic()
            return
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig.head_dim: rotary embeddings need an even head_dim, got {self.head_dim}"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be positive")
        if self.model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ModelConfig.model_type: {self.model_type!r} is not supported "
                f"(supported: {sorted(_SUPPORTED_MODEL_TYPES)})"
            )
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError(
                f"ModelConfig.qk_norm: Qwen3 (and only Qwen3) normalises q and k per head; "
                f"got qk_norm={self.qk_norm} for model_type {self.model_type!r}"
            )
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("ModelConfig.attention_bias: Qwen2 always has q/k/v biases")

    def _check_generic(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: must be a positive integer, got {value!r}")
        if not self.hf_config_json:
            raise ValueError("ModelConfig.hf_config_json: the generic path needs the model's config.json")
        if not self.model_type:
            raise ValueError("ModelConfig.model_type: the generic path needs config.json's model_type")

    @property
    def lora(self) -> LoraSpec | None:
        """The adapter this config describes (None: the model's own weights)."""
        if not self.lora_rank:
            return None
        from services.modeling.lora import LoraSpec

        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_targets)

    @property
    def base(self) -> ModelConfig:
        """The model an adapter config adapts (itself when it is no adapter)."""
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_targets=())

    def with_lora(self, spec: LoraSpec) -> ModelConfig:
        return dataclasses.replace(
            self, lora_rank=spec.rank, lora_alpha=float(spec.alpha), lora_targets=tuple(spec.targets)
        )

    @property
    def hf_config(self) -> dict[str, Any]:
        """The generic model's config.json dictionary."""
        return json.loads(self.hf_config_json)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A tiny Qwen2 for CPU tests and the embedded default; vocab matches CharTokenizer."""
        from services.modeling.tokenizer import CharTokenizer

        base: dict[str, Any] = dict(
            vocab_size=CharTokenizer().vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny_qwen3(cls, **overrides: Any) -> ModelConfig:
        """`tiny()` as a Qwen3: no q/k/v biases, per-head q/k RMSNorm."""
        return cls.tiny(**{"model_type": "qwen3", "attention_bias": False, "qk_norm": True, **overrides})

    def replace(self, **changes: Any) -> ModelConfig:
        if self.generic:  # the config.json is the source of truth; the fields are read from it
            lora = {k: changes.pop(k) for k in ("lora_rank", "lora_alpha", "lora_targets") if k in changes}
            config = ModelConfig.generic_from_hf_dict({**self.hf_config, **changes})
            return dataclasses.replace(
                config,
                **{**{k: getattr(self, k) for k in ("lora_rank", "lora_alpha", "lora_targets")}, **lora},
            )
        return ModelConfig(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of this dataclass (for JSON in our own messages)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}")
        return cls(**d)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json dictionary (transformers.Qwen2Config(**d) accepts it); a
        generic model's carries IMPLEMENTATION_KEY, so a receiver takes the same path."""
        if self.lora_rank:
            return {**self.base.to_hf_dict(), LORA_KEY: self.lora.to_dict()}  # type: ignore[union-attr]
        if self.generic:
            return {**self.hf_config, IMPLEMENTATION_KEY: "generic"}
        d: dict[str, Any] = {
            "architectures": [_SUPPORTED_MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers >= 5 reads rope_parameters, older readers (and vLLM
            # versions before the rename) read rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.model_type == "qwen3":
            d["attention_bias"] = self.attention_bias
            d["max_window_layers"] = self.num_hidden_layers
            d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], implementation: Implementation = "auto") -> ModelConfig:
        """Read a HF config.json dictionary. "fast" refuses features looprl's model code does not
        implement (naming the key), "generic" always takes transformers' code, "auto" (and a
        dictionary carrying IMPLEMENTATION_KEY) the fast path where it can."""
        d = dict(d)
        lora = d.pop(LORA_KEY, None)
        if lora:
            from services.modeling.lora import LoraSpec

            return cls.from_hf_dict(d, implementation).with_lora(LoraSpec.from_dict(lora))
        if d.pop(IMPLEMENTATION_KEY, None) == "generic" or implementation == "generic":
            return cls.generic_from_hf_dict(d)
        try:
            return cls.fast_from_hf_dict(d)
        except (ValueError, KeyError, TypeError):
            if implementation == "fast":
                raise
            return cls.generic_from_hf_dict(d)

    @classmethod
    def generic_from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A config for the generic path: the dictionary as is, sizes read from it."""
        if not isinstance(d.get("model_type"), str) or not d["model_type"]:
            raise ValueError("config.json model_type: missing (transformers needs it to pick the model code)")
        if not isinstance(d.get("vocab_size"), int):
            raise ValueError("config.json vocab_size: missing (a causal LM's config names its vocabulary)")
        d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=int(d.get("hidden_size") or d.get("n_embd") or 1),
            num_hidden_layers=int(d.get("num_hidden_layers") or d.get("n_layer") or 1),
            max_position_embeddings=int(d.get("max_position_embeddings") or d.get("n_positions") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            model_type=d["model_type"],
            attention_bias=False,
            generic=True,
            hf_config_json=json.dumps(d, sort_keys=True),
        )

    @classmethod
    def fast_from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a HF config.json dictionary for the fast path; rejects features it does not implement."""
        model_type = d.get("model_type", "qwen2")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type: {model_type!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if d.get("use_sliding_window", False):
            raise ValueError("config.json use_sliding_window: sliding-window attention is not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json rope type: only 'default' RoPE is supported, got {rope_type!r}")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        if d.get("layer_types") and set(d["layer_types"]) != {"full_attention"}:
            raise ValueError("config.json layer_types: only full attention layers are supported")
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(d.get("attention_bias", False))
            if d.get("mlp_bias", False):
                raise ValueError("config.json mlp_bias: MLP biases are not supported")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            model_type=model_type,
            qk_norm=model_type == "qwen3",
        )


def read_config(directory: str | os.PathLike[str], implementation: Implementation = "auto") -> ModelConfig:
    """The ModelConfig of a checkpoint directory's config.json, on the path `implementation` says."""
    return ModelConfig.from_hf_dict(json.loads((Path(directory) / "config.json").read_text()), implementation)


def with_implementation(config: ModelConfig, implementation: Implementation) -> ModelConfig:
    """`config` (a fast-path preset) on the path `implementation` names."""
    if implementation == "generic" and not config.generic:
        return ModelConfig.from_hf_dict(config.to_hf_dict(), "generic")
    return config


def model_preset(name: str) -> ModelConfig:
    """The config a recipe's `model.preset` builds (shared: the trainer builds it, the gateway checks
    the run's tokenizer against its vocabulary)."""
    if name == "tiny-qwen2":
        return ModelConfig.tiny()
    if name == "tiny-qwen3":
        return ModelConfig.tiny_qwen3()
    if name == "small-qwen2":
        return ModelConfig.tiny(
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            head_dim=32,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
    raise ValueError(f"model.preset: unknown preset {name!r}")
