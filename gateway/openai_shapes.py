"""The OpenAI request fields looprl accepts and the response shapes it returns (completions, chat,
their streamed chunks and log-probs), kept apart from the endpoints that serve them."""

from __future__ import annotations

import math
from typing import Any

from services.kit.errors import InvalidArgument
from services.kit.limits import INT64_MAX
from services.modeling.tokenizer import Tokenizer

# The request fields forwarded as SamplingParams: (kind, default, smallest, largest); a str largest
# names the gateway's RecipeLimits field (the same cluster limit a recipe is held to). OpenAI's own
# ranges where it has one (temperature [0, 2], top_p [0, 1], n <= 128).
OPENAI_FIELDS: dict[str, tuple[type, float, float, float | str]] = {
    "temperature": (float, 1.0, 0.0, 2.0),
    "top_p": (float, 1.0, 0.0, 1.0),
    "max_tokens": (int, 16, 1, "max_tokens"),
    "n": (int, 1, 1, 128),
    "seed": (int, 0, 0, INT64_MAX),
}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
# Sampling features the engines do not implement: refused when set, never silently ignored.
UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "best_of": 1, "echo": False}


def sampling_value(body: dict, name: str, limits: Any) -> Any:
    """One OPENAI_FIELDS field of the body, checked; InvalidArgument names it otherwise."""
    kind, default, low, high = OPENAI_FIELDS[name]
    value = body.get(name)
    if value is None:  # absent or null: OpenAI's default
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidArgument(f"{name}: must be an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{name}: must be a finite number, got {value!r}")
    largest = getattr(limits, high) if isinstance(high, str) else high
    if not low <= value <= largest:
        raise InvalidArgument(f"{name}: must be in [{low}, {largest}], got {value!r}")
    return kind(value)


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop: must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]: must hold 1 to {MAX_STOP_CHARS} characters")
    return stops


def check_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and value != {}:
            raise InvalidArgument(f"{name}: not supported by looprl's engines (leave it unset)")


class Choice:
    """One choice as it is decoded: its tokens, log-probs, text so far, and where a stop string cut it."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.finish: str | None = None

    def add(self, ids: list[int], logprobs: list[float], finish: str) -> None:
        if self.finish is not None:  # already cut by a stop string
            return
        for token, logprob in zip(ids, logprobs, strict=False):
            if token == self.tokenizer.eos_token_id:
                self.finish = "stop"
                return
            self.ids.append(token)
            self.logprobs.append(logprob)
            self.text = self.tokenizer.decode(self.ids)
            cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.finish = self.text[:cut], "stop"
                return
        if finish:
            self.finish = finish

    def pending_text(self, final: bool) -> str:
        """Text not yet streamed that no stop string can still claim (a stop may span chunks)."""
        hold = 0 if final or self.finish else max((len(s) - 1 for s in self.stops), default=0)
        end = len(self.text) - hold
        if not final and self.text[end - 1 : end] == "\ufffd":  # a multi-byte character half sampled
            end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def pieces(self, start: int) -> list[tuple[str, float]]:
        """(token text, log-prob) of the tokens from `start` on."""
        return [
            (self.tokenizer.decode([t]), lp)
            for t, lp in zip(self.ids[start:], self.logprobs[start:], strict=True)
        ]

    def token_logprobs(self) -> list[tuple[str, float]]:
        """(token text, log-prob) of the tokens that made the returned text."""
        out, covered = [], 0
        for token, logprob in zip(self.ids, self.logprobs, strict=True):
            if covered >= len(self.text) and out:
                break
            piece = self.tokenizer.decode([token])
            out.append((piece, logprob))
            covered += len(piece)
        return out


def int_field(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}: must be an integer, got {value!r}")
    if not low <= value <= high:
        why = " (the engines return the sampled token's log-prob, not alternatives)" if high == 0 else ""
        raise InvalidArgument(f"{name}: must be in [{low}, {high}]{why}, got {value!r}")
    return value


def model_entry(model_id: str, created: float, what: str) -> dict:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "looprl", "looprl": what}


def logprobs_json(kind: str, pieces: list[tuple[str, float]]) -> dict:
    if kind == "chat.completion":
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in pieces
            ]
        }
    offsets, at = [], 0
    for t, _ in pieces:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": [t for t, _ in pieces],
        "token_logprobs": [lp for _, lp in pieces],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def choice_json(kind: str, index: int, choice: Choice, logprobs: int | None) -> dict:
    lp = logprobs_json(kind, choice.token_logprobs()) if logprobs is not None else None
    finish = choice.finish or "length"
    if kind == "chat.completion":
        message = {"role": "assistant", "content": choice.text}
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}
    return {"index": index, "text": choice.text, "finish_reason": finish, "logprobs": lp}


def delta(kind: str, index: int, text: str, finish: str | None) -> dict:
    if kind == "chat.completion":
        return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
