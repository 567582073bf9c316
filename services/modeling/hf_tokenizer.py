"""A local Hugging Face tokenizer directory behind CharTokenizer's interface, without importing transformers.

Reads `tokenizer.json` with the `tokenizers` library and the special tokens and chat template from
`tokenizer_config.json` (or `chat_template.jinja`, which transformers >= 5 writes beside it), and
renders the template with jinja2 set up as transformers sets it up (sandboxed, trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the special
tokens as variables), then encodes the text without adding special tokens. So the ids equal
`AutoTokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=True)` at a
fraction of the import cost (transformers takes seconds to import; this takes ~0.5 s).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from services.modeling.chatml import continuation_text, render_chatml
from services.modeling.tool_calls import (
    hermes_messages,
    needs_rewrite,
    normalize_tools,
    template_renders_tools,
    with_object_arguments,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# The special-token attributes a template may read, as transformers passes them.
_SPECIAL_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """A special token as a config holds it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """The jinja2 template compiled in the environment transformers uses for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (applied only when the config asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(f" '{suffix}", f"'{suffix}")
    return text


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json of a local directory; CharTokenizer's interface."""

    def __init__(self, tokenizer: Any, config: dict[str, Any], name: str = "hf") -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL_ATTRIBUTES:
            content = _token_content(config.get(attr))
            if content is not None:
                self.special_tokens[attr] = content
        eos = self.special_tokens.get("eos_token")
        if eos is None or tokenizer.token_to_id(eos) is None:
            raise ValueError(
                f"tokenizer {name}: {TOKENIZER_CONFIG_FILE} names no eos_token in the vocabulary"
            )
        self._eos = int(tokenizer.token_to_id(eos))
        pad = self.special_tokens.get("pad_token")
        pad_id = tokenizer.token_to_id(pad) if pad is not None else None
        self._pad = int(pad_id) if pad_id is not None else self._eos
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template if isinstance(template, str) and template else None
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> HFTokenizer:
        """Load `directory` (tokenizer.json required); a chat_template.jinja file wins over the config's."""
        from tokenizers import Tokenizer

        path = Path(directory)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer: {str(path)!r} has no {TOKENIZER_FILE}")
        config: dict[str, Any] = {}
        special_map = path / SPECIAL_TOKENS_MAP_FILE
        if special_map.is_file():
            config.update(json.loads(special_map.read_text()))
        config_file = path / TOKENIZER_CONFIG_FILE
        if config_file.is_file():
            config.update({k: v for k, v in json.loads(config_file.read_text()).items() if v is not None})
        template_file = path / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(Tokenizer.from_file(str(tokenizer_file)), config, name=str(path))

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (transformers' len(tokenizer))."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(
            i
            for i, tok in self.tokenizer.get_added_tokens_decoder().items()
            if getattr(tok, "special", False)
        )

    def token_to_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise KeyError(token)
        return int(found)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ints = [int(i) for i in ids]
        for i in ints:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        text = self.tokenizer.decode(ints, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The chat template's text for `messages` (ChatML when the directory ships no template);
        ValueError when the template refuses them. Tools go to a template that renders them (Qwen2.5's);
        for one that does not, the conversation is written in the Hermes convention first
        (services/modeling/tool_calls.py), which is what Qwen-family models expect."""
        if self.chat_template is None:
            return render_chatml(messages, add_generation_prompt, tools)
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}]: needs a string 'role'")
        import jinja2

        if tools:
            tools = normalize_tools(tools)
        if (tools or needs_rewrite(messages)) and not template_renders_tools(self.chat_template):
            messages, tools = hermes_messages(messages, tools), None
        template = compile_chat_template(self.chat_template)
        try:
            return template.render(
                messages=[with_object_arguments(m) for m in messages],
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception in the template, or a bad one
            raise ValueError(f"chat template of {self.name}: {exc}") from exc

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def chat_continuation(
        self,
        previous: list[dict[str, Any]],
        new: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Ids after the model's turn (ended by eos) that append `new` messages (see continuation_text)."""
        eos = self.special_tokens["eos_token"]
        render = functools.partial(self.render_chat, tools=tools)
        return self.encode(continuation_text(render, previous, new, eos, add_generation_prompt))
