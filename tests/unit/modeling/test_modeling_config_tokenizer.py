"""ModelConfig round-trips through HF config.json; the tokenizers encode, decode and template chats."""

from __future__ import annotations

import json

import pytest
import transformers

from services.modeling.config import ModelConfig
from services.modeling.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


def test_tiny_config_matches_char_tokenizer_and_roundtrips_through_hf_dict():
    cfg = ModelConfig.tiny()
    assert cfg.vocab_size == CharTokenizer().vocab_size
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_transformers_reads_our_hf_dict():
    cfg = ModelConfig.tiny()
    hf = transformers.Qwen2Config(**cfg.to_hf_dict())
    assert hf.head_dim == cfg.head_dim
    assert hf.num_key_value_heads == cfg.num_key_value_heads
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.tie_word_embeddings is True
    # and what transformers writes reads back here
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg


def test_config_rejects_inconsistent_shapes_and_unsupported_features():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.tiny(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.tiny(hidden_size=0)
    bad = ModelConfig.tiny().to_hf_dict()
    bad["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(bad, "fast")
    # what the fast path does not implement, the generic path (transformers' own code) runs
    generic = ModelConfig.from_hf_dict(bad)
    assert generic.generic and generic.hf_config["rope_parameters"]["rope_type"] == "yarn"
    assert ModelConfig.from_hf_dict(generic.to_hf_dict()) == generic


def test_char_tokenizer_roundtrip_specials_and_chat_template():
    tok = CharTokenizer()
    text = "What is 12+7?\n\tAnswer: 19"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 1
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token_id == tok.token_to_id("<|pad|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\n2+2?\nassistant\n"
    # special strings are literal text when specials are not allowed
    assert len(tok.encode("<|im_end|>", allow_special=False)) == len("<|im_end|>")
    # characters outside the vocabulary are replaced, never crash
    assert tok.decode(tok.encode("é")) == "?"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_char_tokenizer_vocabulary_is_stable():
    # Token ids are a wire contract between services: changing them breaks saved models.
    tok = CharTokenizer()
    assert tok.vocab_size == 101
    assert [tok.token_to_id(s) for s in ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
        3,
    ]
    assert tok.encode("\n\t A~") == [4, 5, 6, 39, 100]


def test_load_tokenizer_char_marker_and_hf_directory(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    CharTokenizer().save_pretrained(tmp_path / "m")
    assert isinstance(load_tokenizer(tmp_path / "m"), CharTokenizer)

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_end|>": 1, "hello": 2, "world": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>"
    )
    fast.save_pretrained(tmp_path / "hf")
    tok = load_tokenizer(tmp_path / "hf")
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_id == 1 and tok.pad_token_id == 1
    assert tok.decode([2, 3]) == "hello world"
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
