"""Every request field of OpenAI's chat and completions APIs, and what looprl does with it.

A field is either served (SERVED: the endpoint reads it and does what OpenAI documents), or
unserved: accepted only at a value that asks for nothing looprl does not do (its neutral value,
e.g. `presence_penalty: 0`, `response_format: {"type": "text"}`, `store: false`) and refused
otherwise with a 400 naming the field and saying why. A field of neither kind is refused as
unknown. Nothing is silently ignored. tests/integration/gateway/test_gateway_openai.py sends every field of
the official `openai` client's request types, read from the installed package, so a field the
client gains fails that test until it has a row here.

Serving an unserved field later (JSON output, say) is: drop its UNSERVED row, add it to SERVED, and
read it in gateway/openai_api.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.kit.rpc.errors import InvalidArgument

log = logging.getLogger("looprl.gateway.openai")

CHAT = "chat.completion"
COMPLETION = "text_completion"

# Read by the endpoints (gateway/openai_api.py, gateway/openai_shapes.py). `top_k` is not OpenAI's:
# it is the sampling parameter vLLM's server takes too (the client sends it in extra_body).
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "stop",
        "logprobs",
        "user",
    }
)
SERVED: dict[str, frozenset[str]] = {
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "safety_identifier",
        "metadata",
        "prompt_cache_key",
        "tools",  # gateway/openai_tools.py, with the next two
        "tool_choice",
        "parallel_tool_calls",
    },
    COMPLETION: _COMMON | {"prompt", "echo", "best_of"},
}


@dataclass(frozen=True)
class Unserved:
    """A field looprl does not serve: `neutral(value)` says whether a value asks for nothing beyond
    what looprl does anyway (None, the field's absence, always does); `why` is the refusal."""

    neutral: Callable[[Any], bool]
    why: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


def _empty(value: Any) -> bool:
    return value in ({}, []) and not isinstance(value, bool)


def _type_is(kind: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and value.get("type") == kind and len(value) == 1


_FUNCTIONS = "deprecated by OpenAI and not served: use tools and tool_choice"

UNSERVED: dict[str, Unserved] = {
    "frequency_penalty": Unserved(_is(0, 0.0), "not supported by looprl's engines (leave it unset or 0)"),
    "presence_penalty": Unserved(_is(0, 0.0), "not supported by looprl's engines (leave it unset or 0)"),
    "logit_bias": Unserved(_empty, "not supported by looprl's engines (leave it unset)"),
    "suffix": Unserved(_is(""), "insertion (text after the completion) is not supported (leave it unset)"),
    "response_format": Unserved(
        _type_is("text"),
        "only {'type': 'text'} is served: the engines do not constrain decoding to JSON",
    ),
    "functions": Unserved(_empty, _FUNCTIONS),
    "function_call": Unserved(_is("none"), _FUNCTIONS),
    "audio": Unserved(lambda _: False, "audio output is not supported (leave it unset)"),
    "modalities": Unserved(_is(["text"]), "only ['text'] is served"),
    "prediction": Unserved(lambda _: False, "predicted outputs are not supported (leave it unset)"),
    "reasoning_effort": Unserved(lambda _: False, "the policy is not a reasoning model (leave it unset)"),
    "verbosity": Unserved(lambda _: False, "not supported (leave it unset)"),
    "web_search_options": Unserved(_empty, "web search is not supported (leave it unset)"),
    "moderation": Unserved(lambda _: False, "moderation is not supported (leave it unset)"),
    "store": Unserved(_is(False), "looprl does not store completions (leave it unset or false)"),
    "service_tier": Unserved(_is("auto", "default"), "only 'auto' and 'default' are served"),
    "prompt_cache_retention": Unserved(
        _is("in_memory"), "only 'in_memory' is served: a replica keeps prompts in its own cache"
    ),
    "prompt_cache_options": Unserved(
        lambda v: _empty(v) or v == {"mode": "implicit"},
        "only the implicit mode is served: a replica caches shared prefixes by itself, for no set time",
    ),
}


def check_fields(body: dict, kind: str) -> None:
    """InvalidArgument naming the first field of `body` that is unknown to the `kind` API or asks for
    something looprl does not serve."""
    for name, value in body.items():
        if name in SERVED[kind] or value is None:
            continue
        rule = UNSERVED.get(name)
        if rule is None:
            raise InvalidArgument(f"{name}: unknown field of {kind} requests")
        if not rule.neutral(value):
            raise InvalidArgument(f"{name}: {rule.why}")


MAX_IDENTIFIER_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def identifiers(body: dict) -> dict[str, Any]:
    """The caller's identifiers of the request (`user`, `safety_identifier`, `metadata`), checked:
    the gateway logs them with the request, so an operator can tell whose traffic it is."""
    out: dict[str, Any] = {}
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > MAX_IDENTIFIER_CHARS:
            raise InvalidArgument(f"{name}: must be a string of at most {MAX_IDENTIFIER_CHARS} characters")
        out[name] = value
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
            raise InvalidArgument(f"metadata: must be an object of at most {MAX_METADATA_PAIRS} pairs")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
                raise InvalidArgument(
                    f"metadata.{key[:MAX_METADATA_KEY]}: keys of at most {MAX_METADATA_KEY} characters, "
                    f"string values of at most {MAX_METADATA_VALUE}"
                )
        out["metadata"] = metadata
    return out


def log_request(kind: str, tenant: str, model: str, ids: dict[str, Any]) -> None:
    """One log line for a request that names its end user (`identifiers`)."""
    if ids:
        log.info("openai request", extra={"fields": {"kind": kind, "tenant": tenant, "model": model, **ids}})
