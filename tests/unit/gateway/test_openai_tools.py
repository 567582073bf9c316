"""OpenAI tool calling on the gateway's chat endpoint: `tools`, `tool_choice`, `parallel_tool_calls`
and tool conversations checked (a bad one is a 400 naming the field), the tools rendered by the chat
template, and the model's Hermes calls returned as `tool_calls`, as vLLM's hermes parser answers.
The official `openai` client reads the replies, streamed and not, from the real HTTP API in front of
a scripted router: a tiny model with random weights writes no call, so the router plays the
model's reply (tests/integration/gateway/test_gateway_openai.py sends the same fields to a real one)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from gateway.auth import TokenAuth
from gateway.http import HttpApi
from gateway.openai_shapes import chat_messages
from gateway.openai_tools import ToolUse
from gateway.servicer import RunManager
from looprl.inference.v1 import inference_pb2
from services.kit.rpc.errors import InvalidArgument
from services.modeling.tokenizer import TokenizerCache
from services.modeling.tool_calls import TOOLS_PREAMBLE
from tests.unit.gateway.test_queue import MemoryStore

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "'required' is not served"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
            "a named function is not served",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "'auto' needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'auto' or 'none'"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name", ""),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function' tools"),
        ({"tools": {"get_weather": WEATHER}}, "tools", "must be a list"),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ],
)
def test_a_tool_request_it_cannot_serve_is_refused_naming_the_field(body, field, says) -> None:
    with pytest.raises(InvalidArgument) as err:
        ToolUse.of(body)
    assert err.value.message.startswith(f"{field}: ") and says in err.value.message


def test_calls_are_parsed_as_vllms_hermes_parser_answers() -> None:
    auto = ToolUse.of({"tools": [WEATHER]})
    message, finish = auto.message("Checking.\n" + CALL + "\n" + CALL, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking.\n"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}] * 2
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert auto.message(CALL, "length")[1] == "length"  # a cut reply stays visible as one
    assert auto.message(CALL, "stop")[0]["content"] is None
    broken = CALL + "\n<tool_call>\n{not json}\n</tool_call>"
    assert auto.message(broken, "stop") == ({"role": "assistant", "content": broken}, "stop")
    assert auto.message("no call", "stop") == ({"role": "assistant", "content": "no call"}, "stop")
    single = ToolUse.of({"tools": [WEATHER], "parallel_tool_calls": False})
    assert len(single.message(CALL + CALL, "stop")[0]["tool_calls"]) == 1
    none = ToolUse.of({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tools and none.message(CALL, "stop") == ({"role": "assistant", "content": CALL}, "stop")
    # Streamed, content stops where a call starts (or may start) until the reply ends.
    assert auto.streamable("Checking.\n<tool_") == len("Checking.\n")
    assert auto.streamable("Checking.\n" + CALL) == len("Checking.\n")
    assert auto.streamable("a < b") == len("a < b") and none.streamable("<tool_call>") == len("<tool_call>")


def test_tool_conversations_are_checked_and_handed_to_the_template_with_object_arguments() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = chat_messages(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
            ]
        }
    )
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    bad_arguments = {**call, "function": {"name": "get_weather", "arguments": "{city"}}
    for message, field in [
        (
            {"role": "assistant", "content": None, "tool_calls": [bad_arguments]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"role": "tool", "content": "sunny"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "hi", "tool_calls": [call]}, "messages[0].tool_calls"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            chat_messages({"messages": [message]})
        assert err.value.message.startswith(f"{field}: "), err.value.message


class ScriptedRouter:
    """The router's Generate and GenerateStream answering `reply` as the model's sampled tokens
    (the eos closing it); each request's prompt ids are kept."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.reply, self.prompts = tokenizer, "", []

    def _ids(self) -> list[int]:
        return [*self.tokenizer.encode(self.reply), self.tokenizer.eos_token_id]

    async def ListDeployments(self, request, timeout=None):
        return inference_pb2.ListDeploymentsResponse(deployments=[inference_pb2.DeploymentInfo(name="d")])

    async def Generate(self, request, timeout=None):
        self.prompts.append(list(request.prompt_token_ids))
        ids = self._ids()
        completion = inference_pb2.Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
        return inference_pb2.GenerateResponse(completions=[completion] * request.sampling.n, deployment="d")

    def GenerateStream(self, request, timeout=None):
        self.prompts.append(list(request.request.prompt_token_ids))
        ids = self._ids()

        async def chunks():
            for start in range(0, len(ids), 5):  # five tokens a chunk: a call's tag spans chunks
                last = start + 5 >= len(ids)
                yield inference_pb2.GenerateStreamResponse(
                    index=0,
                    token_ids=ids[start : start + 5],
                    logprobs=[-0.5] * len(ids[start : start + 5]),
                    finish_reason="stop" if last else "",
                    deployment="d",
                )

        return chunks()


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, ScriptedRouter]]:
    """The gateway's HTTP API on a local port, in a thread of its own."""
    tokenizers = TokenizerCache()
    router = ScriptedRouter(tokenizers.get())
    api = HttpApi(RunManager(None, MemoryStore(), Path(".")), TokenAuth(["secret"]), router, tokenizers)  # type: ignore[arg-type]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(api.app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1", router
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_official_client_gets_the_models_calls_as_tool_calls_streamed_or_not(gateway) -> None:
    import openai

    base_url, router = gateway
    client = openai.OpenAI(base_url=base_url, api_key="secret", max_retries=0)
    router.reply = "Let me check.\n" + CALL
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "rain"},
        {"role": "user", "content": "And Paris?"},
    ]
    reply = client.chat.completions.create(model="d", messages=conversation, tools=[WEATHER], max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # The template rendered the tools, the past call and its result (the shipped ChatML: Hermes).
    prompt = router.tokenizer.decode(router.prompts[-1])
    assert TOOLS_PREAMBLE in prompt and '"name": "get_weather"' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt
    # Streamed: the content before the call, then the call whole, as the client accumulates them.
    chunks = list(
        client.chat.completions.create(
            model="d", messages=conversation, tools=[WEATHER], max_tokens=64, stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check.\n" and "<tool_call>" not in content
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": the tools are shown, the reply is text.
    plain = client.chat.completions.create(
        model="d", messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=64
    )
    assert plain.choices[0].message.content == router.reply and not plain.choices[0].message.tool_calls
    # What the engines cannot do is refused naming the field, and nothing is generated.
    asked = len(router.prompts)
    for choice_field in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="d", messages=conversation, tools=[WEATHER], tool_choice=choice_field, max_tokens=8
            )
        assert err.value.param == "tool_choice"
    assert len(router.prompts) == asked
