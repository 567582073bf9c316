"""How looprl reads the OpenAI request fields it serves (sampling, messages, stream options, best_of)
and the response shapes it returns (completions, chat, their streamed chunks and log-probs), kept
apart from the endpoints that serve them. Which fields are served at all: gateway/openai_fields.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.openai_tools import NO_TOOLS, ToolUse, assistant_tool_calls
from services.kit.config.limits import INT32_MAX, INT64_MAX
from services.kit.rpc.errors import InvalidArgument
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
    "top_k": (int, 0, 0, INT32_MAX),  # not OpenAI's; vLLM's server takes it too (0: off)
}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_CACHE_KEY_CHARS = 256
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# What a message may carry besides role and content: an assistant turn its tool calls, a tool
# result the id of the call it answers.
MESSAGE_EXTRAS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}


def sampling_value(body: dict, name: str, limits: Any, rule: str = "") -> Any:
    """One OPENAI_FIELDS field of the body (read under `rule`'s bounds when given), checked;
    InvalidArgument names it otherwise."""
    kind, default, low, high = OPENAI_FIELDS[rule or name]
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


def sampling_values(body: dict, limits: Any) -> dict[str, Any]:
    """The SamplingParams fields of the body. `max_completion_tokens` (chat) is OpenAI's newer name
    of `max_tokens`: either sets it, and both set must agree."""
    values = {name: sampling_value(body, name, limits) for name in OPENAI_FIELDS}
    if body.get("max_completion_tokens") is not None:
        wanted = sampling_value(body, "max_completion_tokens", limits, rule="max_tokens")
        if body.get("max_tokens") is not None and wanted != values["max_tokens"]:
            raise InvalidArgument(
                f"max_completion_tokens: {wanted} differs from max_tokens {values['max_tokens']}; set one"
            )
        values["max_tokens"] = wanted
    return values


def bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{name}: must be a boolean, got {value!r}")
    return bool(value)


def stream_options(body: dict, stream: bool) -> dict[str, bool]:
    """`stream_options` (include_usage, include_obfuscation), allowed only with stream, as OpenAI."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not stream:
        raise InvalidArgument("stream_options: only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options: must be an object")
    for key, value in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise InvalidArgument(
                f"stream_options.{key}: unknown option (include_usage, include_obfuscation)"
            )
        if value is not None and not isinstance(value, bool):
            raise InvalidArgument(f"stream_options.{key}: must be a boolean, got {value!r}")
    return {k: bool(v) for k, v in options.items()}


def best_of_n(body: dict, limits: Any, stream: bool) -> tuple[int, int]:
    """(n, best_of or 0): a completions request samples best_of choices and returns the n with the
    highest log-prob per token; not with stream (the best are known only at the end), as OpenAI."""
    n = sampling_value(body, "n", limits)
    best_of = int_field(body, "best_of", 1, 128)
    if best_of is None or best_of == n:
        return n, 0
    if best_of < n:
        raise InvalidArgument(f"best_of: must be >= n ({n}), got {best_of}")
    if stream:
        raise InvalidArgument("best_of: cannot be used with stream (the best choices are known at the end)")
    return n, best_of


def cache_session(body: dict, tenant: str) -> str:
    """The router session of `prompt_cache_key`: requests sharing it go to the replica that holds
    their prefix in its cache (affinity), as OpenAI's key routes to its cache. Scoped by tenant, so
    one tenant's key never steers another's requests."""
    key = body.get("prompt_cache_key")
    if key is None:
        return ""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_CACHE_KEY_CHARS:
        raise InvalidArgument(f"prompt_cache_key: must be a string of 1 to {MAX_CACHE_KEY_CHARS} characters")
    return f"openai/{tenant}/{key}"


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: role and text content per message, an
    assistant turn's past tool calls (arguments as objects) and a tool result's call id. Text
    content parts are joined; `developer` is the system role under its newer name. Anything else a
    message carries (images, audio, names) is refused naming it, never dropped."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]: needs string 'role' and 'content'")
        extras = MESSAGE_EXTRAS.get(m["role"], ())
        for key, value in m.items():
            if key not in ("role", "content", *extras) and value is not None:
                raise InvalidArgument(
                    f"messages[{i}].{key}: not supported (a message is its role and content"
                    + (f", and {', '.join(extras)})" if extras else ")")
                )
        role = CHAT_ROLES.get(m["role"])
        if role is None:
            raise InvalidArgument(
                f"messages[{i}].role: {m['role']!r} is not served (system, developer, user, assistant, tool)"
            )
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        message: dict[str, Any] = {
            "role": role,
            "content": "" if content is None and calls else _text(content, f"messages[{i}].content"),
        }
        if calls is not None:
            message["tool_calls"] = assistant_tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise InvalidArgument(f"messages[{i}].tool_call_id: must be the id of the call it answers")
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}: must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidArgument(f"{where}[{j}].type: only text parts are served, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


class Choice:
    """One choice as it is decoded: its tokens, log-probs, text so far, and where a stop string cut it."""

    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], streamable: Callable[[str], int] | None = None
    ) -> None:
        """`streamable(text)`: how much of the text so far may be streamed (tool calls are held)."""
        self.tokenizer, self.stops, self.streamable = tokenizer, stops, streamable
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
        if not final and self.streamable is not None:
            end = min(end, self.streamable(self.text))
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def mean_logprob(self) -> float:
        """Log-prob per token of what it sampled (best_of ranks choices by it)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0

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


def choice_json(
    kind: str,
    index: int,
    choice: Choice,
    logprobs: int | None,
    prefix: str = "",
    tools: ToolUse = NO_TOOLS,
) -> dict:
    """One choice of the reply; a completion's text after `prefix` (its prompt, with echo), a chat
    reply's tool calls parsed as `tools` asks."""
    lp = logprobs_json(kind, choice.token_logprobs()) if logprobs is not None else None
    finish = choice.finish or "length"
    if kind == "chat.completion":
        message, finish = tools.message(choice.text, finish)
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}
    return {"index": index, "text": prefix + choice.text, "finish_reason": finish, "logprobs": lp}


def delta(kind: str, index: int, text: str, finish: str | None) -> dict:
    if kind == "chat.completion":
        return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
