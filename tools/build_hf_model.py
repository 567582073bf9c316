"""Build, offline, a small causal LM checkpoint in Hugging Face format with a byte-level BPE tokenizer.

    python tools/build_hf_model.py --out models/tiny-bpe-qwen2 [--arch qwen2] [--seed 0] ...

`--arch` is the architecture: qwen2 (default), qwen3 and llama are built by looprl's fast-path
model; any other transformers model_type (mistral, gemma, ...) by transformers' own code from its
config class (the generic path). Writes config.json, model.safetensors, generation_config.json
(eos/pad/bos ids), tokenizer.json (byte-level BPE trained with `tokenizers` on the shipped corpus
tools/data/hf_corpus.txt, Qwen's pre-tokenizer regex, <|endoftext|> <|im_start|> <|im_end|> as
special tokens after the merges), tokenizer_config.json (Qwen2-Instruct's chat template, eos
<|im_end|>, pad <|endoftext|>) and a README.md model card. The same arguments give the same bytes.
`transformers.AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(out)` load it; so do
looprl's `causal_lm.load` and `load_tokenizer`. The weights are a seeded random
init (model.init_std); the default size (~1.1M parameters) trains quickly on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from services.modeling.config import ModelConfig  # noqa: E402
from services.modeling.hf_files import (  # noqa: E402
    QWEN_CHAT_TEMPLATE,
    set_byte_level_pipeline,
    write_generation_files,
    write_model_card,
    write_tokenizer_config,
)
from services.modeling.tokenizer import EOT, IM_END, IM_START, load_tokenizer  # noqa: E402
from tools.hf_warm_start import chat_examples, warm_start  # noqa: E402

DEFAULT_CORPUS = ROOT / "tools" / "data" / "hf_corpus.txt"
SPECIALS = (EOT, IM_START, IM_END)


def train_bpe(corpus: str, vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of at most vocab_size ids, the 3 specials last."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIALS) + 1:
        raise ValueError(f"--vocab-size: must be > {256 + len(SPECIALS)} (the 256 bytes and the specials)")
    tok = Tokenizer(models.BPE())
    set_byte_level_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIALS),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def architecture_config(arch: str, sizes: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a small `arch` model of these sizes (ValueError naming --arch)."""
    if arch in ("qwen2", "llama"):
        return ModelConfig(**sizes, model_type=arch, attention_bias=arch == "qwen2")
    if arch == "qwen3":
        return ModelConfig(**sizes, model_type="qwen3", attention_bias=False, qk_norm=True)
    from transformers import AutoConfig

    try:  # transformers' own config class of the architecture, with its defaults for the rest
        hf = AutoConfig.for_model(arch, **sizes)
    except ValueError as exc:
        raise ValueError(f"--arch: transformers has no architecture {arch!r} ({exc})") from None
    d = hf.to_dict()
    d.pop("sliding_window", None)  # a window longer than the model: full attention, stated plainly
    return ModelConfig.from_hf_dict(d, "generic")


def build(
    out: Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_positions: int = 2048,
    init_std: float = 0.02,
    corpus_path: Path = DEFAULT_CORPUS,
    sft_steps: int = 0,
    sft_examples: list[tuple[list[dict[str, str]], str]] | None = None,
    arch: str = "qwen2",
) -> dict[str, Any]:
    """Write the model directory; returns a summary (parameters, vocabulary, file sizes).

    `sft_steps` of warm start learn `sft_examples` ((prompt messages, answer) pairs, e.g. from
    tools.hf_warm_start.environment_examples) when given, else the corpus' worked math problems."""
    from services.modeling import causal_lm

    # Everything is checked (sizes, corpus, tokenizer training) before anything is written.
    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    config = architecture_config(arch, sizes)
    if not init_std > 0:
        raise ValueError(f"--init-std: must be > 0, got {init_std}")
    if sft_steps < 0:
        raise ValueError(f"--sft-steps: must be >= 0, got {sft_steps}")
    corpus = corpus_path.read_text()
    tok = train_bpe(corpus, vocab_size)
    config = config.replace(vocab_size=tok.get_vocab_size(with_added_tokens=True))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(
        out,
        tok,
        eos_token=IM_END,
        pad_token=EOT,
        chat_template=QWEN_CHAT_TEMPLATE,
        model_max_length=max_positions,
    )
    model = causal_lm.build(config, seed, init_std)
    warm = {}
    if sft_steps:
        examples = chat_examples(corpus) if sft_examples is None else sft_examples
        warm = warm_start(model, load_tokenizer(out), examples, sft_steps, seed)
    model.save_pretrained(out)
    ids = write_generation_files(out, str(out))
    params = sum(p.numel() for p in model.parameters())
    taught = "the corpus' math problems" if sft_examples is None else f"{len(sft_examples)} given answers"
    corpus_sha = hashlib.sha256(corpus_path.read_bytes()).hexdigest()[:16]
    facts = {
        "architecture": f"{arch} ({'generic path' if config.generic else 'fast path'})",
        "parameters": f"{params:,}",
        "vocabulary": f"{config.vocab_size} (byte-level BPE, specials {', '.join(SPECIALS)})",
        "layers / hidden / heads / kv heads": f"{num_layers} / {hidden_size} / {num_heads} / {num_kv_heads}",
        "eos / pad / bos ids": f"{ids['eos_token_id']} / {ids['pad_token_id']} / {ids['bos_token_id']}",
        "init": f"N(0, {init_std}) with seed {seed}",
        "warm start": (
            f"{sft_steps} SFT steps on {taught} as chat turns "
            f"(loss {warm['first_loss']:.2f} -> {warm['last_loss']:.2f})"
            if warm
            else "none (untrained)"
        ),
        "tokenizer corpus": f"{corpus_path.name} (sha256 {corpus_sha}...)",
        "built by": "tools/build_hf_model.py",
    }
    write_model_card(
        out,
        title=f"looprl tiny BPE {arch} (seed {seed})",
        facts=facts,
        note="A small model for offline tests and CPU recipes (configs/hf_math_grpo.toml).",
    )
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return {
        "out": str(out),
        "parameters": params,
        "vocab_size": config.vocab_size,
        **ids,
        **warm,
        "files": sizes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="Output directory (created).")
    parser.add_argument(
        "--arch",
        default="qwen2",
        help="qwen2, qwen3, llama (fast path) or any transformers model_type (generic path), e.g. gemma.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weight init.")
    parser.add_argument("--vocab-size", type=int, default=1024, help="Largest vocabulary, specials included.")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="Text the BPE is trained on.")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="Supervised steps on the corpus' math problems as chat turns (0: an untrained init).",
    )
    args = parser.parse_args(argv)
    try:
        summary = build(
            args.out,
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            max_positions=args.max_positions,
            init_std=args.init_std,
            corpus_path=args.corpus,
            sft_steps=args.sft_steps,
            arch=args.arch,
        )
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(f"{summary['out']}: {summary['parameters']:,} parameters, vocabulary {summary['vocab_size']}")
    if "last_loss" in summary:
        print(f"  warm start: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}")
    for name, size in summary["files"].items():
        print(f"  {name}: {size:,} bytes")


if __name__ == "__main__":
    main()
