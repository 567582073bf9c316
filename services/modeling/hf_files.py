"""The files of a Hugging Face model directory besides the weights: tokenizer, generation config, model card.

Shared by the trainer's export and tools/build_hf_model.py, so both write directories that plain
`transformers` (`AutoTokenizer`, `AutoModelForCausalLM`, `generate()`) loads and stops on eos.
Nothing here imports transformers: tokenizer files are written with the `tokenizers` library and
a hand-written tokenizer_config.json that names `PreTrainedTokenizerFast` (read by transformers 4
and 5 alike) and carries the chat template.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from services.modeling.hf_tokenizer import (
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    HFTokenizer,
)
from services.modeling.tokenizer import EOT, IM_END, IM_START, PAD, CharTokenizer, load_tokenizer
from services.modeling.tool_calls import TOOLS_POSTAMBLE, TOOLS_PREAMBLE

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CARD_FILE = "README.md"
# Marker of a CharTokenizer directory (see CharTokenizer.save_pretrained).
CHAR_MARKER_FILE = "looprl_tokenizer.json"
# Files that make up a tokenizer, copied as they are from a tokenizer directory.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    CHAR_MARKER_FILE,
)

# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, whitespace.
QWEN_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _chat_template(default_system: bool) -> str:
    """ChatML in Jinja with tools in the Hermes convention, as Qwen2.5's template writes them (and as
    services/modeling/tool_calls.hermes_messages rewrites a conversation): the tools block in the
    system turn, past tool calls after the assistant's content, each run of tool results in one user
    turn. `default_system`: a default system turn when the conversation has none (Qwen's habit)."""
    tools_block = (
        "{% if tools %}"
        "{{ '<|im_start|>system\\n' }}"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
        "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
        "{{ " + repr(TOOLS_PREAMBLE) + " }}"
        "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
        "{{ " + repr(TOOLS_POSTAMBLE + "<|im_end|>\n") + " }}"
        "{% endif %}"
    )
    default = (
        "{% if not tools and loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{% endif %}"
        if default_system
        else ""
    )
    return (
        tools_block
        + "{% for message in messages %}"
        + default
        + "{% if tools and loop.first and message['role'] == 'system' %}"
        "{% elif message['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
        "{{ '<|im_start|>assistant' }}"
        "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
        "{% for call in message['tool_calls'] %}"
        "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
        "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{{ call['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
        "{% endfor %}"
        "{{ '<|im_end|>\\n' }}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


# A Jinja copy of tokenizer.render_chatml: what CharTokenizer.apply_chat_template renders.
CHATML_TEMPLATE = _chat_template(default_system=False)
# Qwen2.5-Instruct's template: a default system turn when the conversation has none, then ChatML,
# tools in the Hermes convention.
QWEN_CHAT_TEMPLATE = _chat_template(default_system=True)


def write_tokenizer_config(
    directory: str | os.PathLike[str],
    tokenizer: Any,
    *,
    eos_token: str,
    pad_token: str,
    chat_template: str,
    model_max_length: int,
    unk_token: str | None = None,
) -> None:
    """tokenizer_config.json for a `tokenizers.Tokenizer` (its added tokens listed as transformers does)."""
    added = {
        str(i): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for i, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": unk_token,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    Path(directory, TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def set_byte_level_pipeline(tokenizer: Any) -> None:
    """Qwen2's normalizer, pre-tokenizer and decoder on a `tokenizers.Tokenizer` (in place)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()


def char_tokenizer_object(char: CharTokenizer) -> Any:
    """A `tokenizers.Tokenizer` giving CharTokenizer's ids on ASCII text: a byte-level BPE with no
    merges whose vocabulary is CharTokenizer's, in order, in byte-level spelling, specials as added
    tokens. Byte-level, because transformers >= 5 loads every qwen2 checkpoint's tokenizer as
    Qwen2Tokenizer, which rebuilds Qwen's byte-level pipeline around the file's vocabulary and
    merges (a WordLevel tokenizer.json would lose newlines there). Characters outside the
    vocabulary are dropped (CharTokenizer encodes them as '?')."""
    from tokenizers import Tokenizer, models

    names = bytes_to_unicode()
    specials = char.special_token_ids
    vocab = {}
    for i in range(char.vocab_size):
        text = char.decode([i])
        vocab[text if i in specials else names[ord(text)]] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    set_byte_level_pipeline(tok)
    tok.add_special_tokens([PAD, EOT, IM_START, IM_END])
    return tok


def write_char_tokenizer(directory: str | os.PathLike[str], model_max_length: int = 2048) -> None:
    """CharTokenizer as HF tokenizer files (and its marker, so load_tokenizer gives a CharTokenizer back)."""
    char = CharTokenizer()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer_object(char)
    tok.save(str(path / TOKENIZER_FILE))
    write_tokenizer_config(
        path,
        tok,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )
    char.save_pretrained(path)


def write_tokenizer_files(spec: str, directory: str | os.PathLike[str], model_max_length: int = 2048) -> None:
    """The run's tokenizer into `directory`: "char" is written out, a directory's files are copied."""
    if os.fspath(spec) == "char":
        write_char_tokenizer(directory, model_max_length)
        return
    source = Path(spec)
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer: {spec!r} is neither 'char' nor a local directory")
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise FileNotFoundError(f"tokenizer: {spec!r} holds none of {', '.join(TOKENIZER_FILES)}")
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name in found:
        if Path(source, name).resolve() != Path(directory, name).resolve():
            shutil.copyfile(source / name, Path(directory) / name)


def special_ids(tokenizer: CharTokenizer | HFTokenizer) -> dict[str, Any]:
    """eos (one id and the stop list), pad and bos ids of a tokenizer, Qwen's way: generation stops on
    the turn end and on <|endoftext|>; bos_token_id names <|endoftext|> although no bos is prepended."""
    eos = tokenizer.eos_token_id
    try:
        endoftext: int | None = tokenizer.token_to_id(EOT)
    except KeyError:
        endoftext = None
    stops = [eos] + ([endoftext] if endoftext is not None and endoftext != eos else [])
    return {
        "eos_token_id": eos,
        "stop_ids": stops,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": endoftext if endoftext is not None else eos,
    }


def write_generation_files(directory: str | os.PathLike[str], tokenizer_spec: str) -> dict[str, Any]:
    """eos/pad/bos ids into config.json and generation_config.json, from the tokenizer files already in
    `directory` (or `tokenizer_spec`); returns the ids."""
    path = Path(directory)
    tokenizer = load_tokenizer(path if (path / TOKENIZER_FILE).is_file() else tokenizer_spec)
    ids = special_ids(tokenizer)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(
        eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"], bos_token_id=ids["bos_token_id"]
    )
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["stop_ids"],
        "pad_token_id": ids["pad_token_id"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
    }
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def _cell(value: Any) -> str:
    """A markdown table cell: pipes (as in <|im_end|>) would end the cell."""
    return str(value).replace("|", "\\|")


def write_model_card(
    directory: str | os.PathLike[str],
    *,
    title: str,
    facts: dict[str, Any],
    recipe: dict[str, Any] | None = None,
    note: str = "",
) -> None:
    """README.md: a transformers model card with the facts as a table and the recipe as JSON."""
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [looprl, qwen2]",
        "---",
        "",
        f"# {title}",
        "",
    ]
    if note:
        lines += [note, ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {key} | {_cell(value)} |" for key, value in facts.items()]
    lines.append("")
    if recipe:
        lines += ["## Recipe", "", "```json", json.dumps(recipe, indent=2, default=str), "```", ""]
    Path(directory, MODEL_CARD_FILE).write_text("\n".join(lines))
