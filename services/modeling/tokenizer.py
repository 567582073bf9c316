"""Tokenizers behind one small interface: a shipped character tokenizer and a wrapper over HF tokenizers.

CharTokenizer needs no download: its vocabulary is fixed in this file (4 ChatML specials, newline,
tab and printable ASCII), so the tiny embedded model, the environments and the engines always agree
on token ids. Its chat template is ChatML kept deliberately short, because the tiny model has to
learn the format quickly. `load_tokenizer("char")` gives it; `load_tokenizer(<directory>)` gives a
CharTokenizer when the directory was written by `CharTokenizer.save_pretrained`, and otherwise an
HFTokenizer over the directory's tokenizer.json and chat template (services/modeling/hf_tokenizer.py).
`TokenizerCache` keeps one loaded tokenizer per spec, so services that serve many runs load each
run's tokenizer once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from services.modeling.chatml import EOT, IM_END, IM_START, PAD, continuation_text, render_chatml
from services.modeling.hf_tokenizer import HFTokenizer

SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOT, IM_START, IM_END)
# Order is part of the contract: ids are positions in this tuple. Never reorder, only append.
_CHARS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(32, 127)))
_MARKER_FILE = "looprl_tokenizer.json"
# Characters outside the vocabulary are encoded as this one, so any user text can be encoded.
_REPLACEMENT = "?"


class Tokenizer(Protocol):
    """What the engines, the agent loop and the trainer ask of a tokenizer (CharTokenizer,
    HFTokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str: ...

    def chat_continuation(
        self,
        previous: list[dict[str, Any]],
        new: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]: ...


class CharTokenizer(Tokenizer):
    """One token per character; ChatML specials are single tokens."""

    name = "char"

    def __init__(self) -> None:
        self._id_to_token: tuple[str, ...] = (*SPECIAL_TOKENS, *_CHARS)
        self._token_to_id = {tok: i for i, tok in enumerate(self._id_to_token)}
        self._replacement_id = self._token_to_id[_REPLACEMENT]
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def pad_token_id(self) -> int:
        return self._token_to_id[PAD]

    @property
    def eos_token_id(self) -> int:
        # A chat model's turn ends with <|im_end|>; that is what generation stops on.
        return self._token_to_id[IM_END]

    @property
    def endoftext_token_id(self) -> int:
        return self._token_to_id[EOT]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def token_to_id(self, token: str) -> int:
        return self._token_to_id[token]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings become their single ids when allow_special."""
        ids: list[int] = []
        chunks = self._special_re.split(text) if allow_special else [text]
        for chunk in chunks:
            if not chunk:
                continue
            special = self._token_to_id.get(chunk) if allow_special and chunk in SPECIAL_TOKENS else None
            if special is not None:
                ids.append(special)
                continue
            get = self._token_to_id.get
            ids.extend(get(ch, self._replacement_id) for ch in chunk)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        n_special = len(SPECIAL_TOKENS)
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            if skip_special_tokens and i < n_special:
                continue
            out.append(self._id_to_token[i])
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        return self.encode(render_chatml(messages, add_generation_prompt, tools))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        return render_chatml(messages, add_generation_prompt, tools)

    def chat_continuation(
        self,
        previous: list[dict[str, Any]],
        new: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Ids after the model's turn (ended by eos) that append `new` messages (see continuation_text)."""
        render = functools.partial(render_chatml, tools=tools)
        return self.encode(continuation_text(render, previous, new, IM_END, add_generation_prompt))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Mark a model directory as using this tokenizer, so load_tokenizer(directory) finds it."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, _MARKER_FILE), "w") as f:
            json.dump({"type": "char", "vocab_size": self.vocab_size}, f)


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> CharTokenizer | HFTokenizer:
    """ "char" -> CharTokenizer; a directory -> CharTokenizer if marked, else its tokenizer.json (local only)."""
    path = os.fspath(path_or_name)
    if path == "char":
        return CharTokenizer()
    marker = os.path.join(path, _MARKER_FILE)
    if os.path.isfile(marker):
        with open(marker) as f:
            kind = json.load(f).get("type")
        if kind != "char":
            raise ValueError(f"{marker}: unknown tokenizer type {kind!r}")
        return CharTokenizer()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer: {path!r} is neither 'char' nor a local directory")
    return HFTokenizer.from_directory(path)


class TokenizerCache:
    """Loaded tokenizers by spec ("char" or a directory, the recipe's `model.tokenizer`), least recently
    used evicted past `max_entries`. An empty spec means `default` (a spec, or a tokenizer object).
    A spec that does not load raises ValueError naming the directory and is not cached, so a
    directory created later loads on the next call."""

    def __init__(self, default: str | Tokenizer = "char", max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Tokenizer] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        if isinstance(default, str):
            self.default_spec = default or "char"
        else:  # a tokenizer object: it is what an empty spec gets, never evicted
            self.default_spec = ""
            self._default = default

    @staticmethod
    def key(spec: str) -> str:
        """One key per tokenizer: "char", or the directory's real path (so spellings of a path share)."""
        return spec if spec == "char" else os.path.realpath(spec)

    def _cached(self, spec: str) -> Tokenizer | None:
        if not spec and not self.default_spec:
            return self._default
        found = self._entries.get(self.key(spec or self.default_spec))
        if found is not None:
            self._entries.move_to_end(self.key(spec or self.default_spec))
        return found

    def _load(self, spec: str) -> Tokenizer:
        try:
            return load_tokenizer(spec)
        except (OSError, ValueError) as exc:  # the message names the directory and what it lacks
            raise ValueError(str(exc)) from exc
        except Exception as exc:  # tokenizers' own errors (a corrupt tokenizer.json) are plain Exceptions
            raise ValueError(f"tokenizer: {spec!r} does not load: {exc}") from exc

    def _store(self, spec: str, tokenizer: Tokenizer) -> Tokenizer:
        self._entries[self.key(spec)] = tokenizer
        self._entries.move_to_end(self.key(spec))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return tokenizer

    def get(self, spec: str = "") -> Tokenizer:
        """The tokenizer of `spec`, loaded in this thread on first use."""
        found = self._cached(spec)
        if found is not None:
            return found
        spec = spec or self.default_spec
        return self._store(spec, self._load(spec))

    async def aget(self, spec: str = "") -> Tokenizer:
        """`get` for async services: a directory loads (~0.7 s) in a thread, once however many
        callers ask for it at the same time."""
        found = self._cached(spec)
        if found is not None:
            return found
        spec = spec or self.default_spec
        key = self.key(spec)
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._load, spec))
            self._loading[key] = pending
            pending.add_done_callback(lambda done: self._loaded(spec, key, done))
        # Shielded: one caller cancelled (its episode dropped) does not cancel the others' load.
        return await asyncio.shield(pending)

    def _loaded(self, spec: str, key: str, done: asyncio.Future) -> None:
        self._loading.pop(key, None)
        if not done.cancelled() and done.exception() is None:
            self._store(spec, done.result())
