"""Every request field of the official `openai` client's chat and completions types (read from the
installed package, so a field the client gains fails here) has a rule: served, or unserved with the
value it accepts and the reason it refuses any other; a field of neither kind is refused as unknown."""

from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from gateway.openai_fields import CHAT, COMPLETION, SERVED, UNSERVED, check_fields
from services.kit.rpc.errors import InvalidArgument

CLIENT_TYPES = {CHAT: chat_create_params, COMPLETION: completion_create_params}


def client_fields(kind: str) -> set[str]:
    """The request body fields the official client sends for `kind` (streaming or not)."""
    module = CLIENT_TYPES[kind]
    return {
        name
        for params in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming)
        for name in typing.get_type_hints(params)
    }


@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
def test_every_field_of_the_official_client_is_served_or_has_a_refusal(kind: str) -> None:
    ruled = SERVED[kind] | set(UNSERVED)
    assert client_fields(kind) - ruled == set(), "fields of the client looprl says nothing about"
    assert client_fields(kind) >= {"model", "stream", "max_tokens"}  # the enumeration reads real fields


def test_an_unserved_field_passes_only_at_its_neutral_value_and_is_refused_naming_it_otherwise() -> None:
    check_fields(
        {"presence_penalty": 0, "response_format": {"type": "text"}, "store": False, "functions": []}, CHAT
    )
    check_fields({"function_call": None, "service_tier": "auto", "prompt_cache_retention": "in_memory"}, CHAT)
    for body, field in [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),  # a boolean is not the number 0
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"store": True}, "store"),
        ({"suffix": "tail"}, "suffix"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),  # not a field of either API
        ({"best_of": 2}, "best_of"),  # a completions field, unknown to chat
    ]:
        with pytest.raises(InvalidArgument) as err:
            check_fields(body, CHAT)
        assert err.value.message.startswith(f"{field}: "), (body, err.value.message)
    with pytest.raises(InvalidArgument, match=r"^messages: unknown field of text_completion"):
        check_fields({"messages": []}, COMPLETION)
