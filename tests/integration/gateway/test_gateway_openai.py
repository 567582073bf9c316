"""The OpenAI-compatible endpoints of a real gateway in front of a real inference-router with one
replica of a tiny Qwen2 that serves weights: out-of-range fields are OpenAI-shaped 400s naming the
field (the gateway's checks, and the router's renamed to OpenAI's fields), and valid requests are
served before and after them."""

from __future__ import annotations

import time

import pytest

from bench.harness.local_fleet import RouterProcess, load_weights, replica_actor, tiny_checkpoint
from tests.support.gateway import TOKEN, GatewayProcess, http, openai_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEPLOYMENT = {
    "name": "d",
    "num_cpus": 0.5,
    "replicas": 1,
    "tensor_parallel": 1,
    "max_model_len": 1024,  # room for a tools block (one token a character)
    "max_batch_size": 4,
}


@pytest.fixture(scope="module")
def served(ray_client, nats_url: str, tmp_path_factory: pytest.TempPathFactory):
    import ray

    tmp = tmp_path_factory.mktemp("openai")
    router = RouterProcess([DEPLOYMENT], tmp / "router.log", status_interval_s=0.2)
    gateway = None
    try:
        router.wait_serving(timeout=150)
        config, weights = tiny_checkpoint(seed=0)
        ray.get(load_weights(replica_actor("d", 0, router.namespace), config, weights, 1), timeout=120)
        gateway = GatewayProcess(nats_url, tmp, router_address=router.address).start()
        yield gateway, config
    finally:
        if gateway is not None:
            gateway.kill()
        router.stop()


def _completion(gateway: GatewayProcess, timeout: float = 60) -> dict:
    """A valid completion, retried while the router has not yet seen the replica's version."""
    deadline = time.monotonic() + timeout
    while True:
        status, reply = http(gateway, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "seed": 7})
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, reply
            return reply
        time.sleep(0.3)


def test_out_of_range_fields_are_openai_400s_and_the_endpoint_keeps_serving(served) -> None:
    gateway, config = served
    assert len(_completion(gateway)["choices"]) == 1
    vocab = config.vocab_size
    bad = [
        ({"prompt": [1, 2**40]}, "prompt", "prompt[1]: token id 1099511627776 is outside [0, 2147483647]"),
        (
            {"prompt": [1, vocab]},
            "prompt",
            f"prompt[1]: token id {vocab} is outside the vocabulary [0, {vocab})",
        ),
        ({"prompt": [1], "max_tokens": 10**12}, "max_tokens", "max_tokens: must be in [1, 131072]"),
        ({"prompt": [1], "max_tokens": 1024}, "max_tokens", "max_tokens: prompt + max_tokens = 1025 exceeds"),
        ({"prompt": [1], "seed": 2**70}, "seed", "seed: must be in [0, 9223372036854775807]"),
        ({"prompt": [1], "n": -1}, "n", "n: must be in [1, 128]"),
        ({"prompt": [1], "temperature": "warm"}, "temperature", "temperature: must be a number"),
    ]
    for body, param, text in bad:
        status, reply = http(gateway, "/v1/completions", body)
        error = openai_error(reply)
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), (body, reply)
        assert error["message"].startswith(text), (body, error)
    again = _completion(gateway)
    assert again["choices"][0]["text"] == _completion(gateway)["choices"][0]["text"]  # seeded: same text
    status, chat = http(
        gateway,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "12"}], "max_tokens": 3, "n": 2},
    )
    assert status == 200 and len(chat["choices"]) == 2, chat


def _client(gateway: GatewayProcess, key: str = TOKEN):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key=key, max_retries=0)


def test_the_official_openai_client_lists_models_and_samples_with_every_documented_option(served) -> None:
    import openai

    gateway, _config = served
    _completion(gateway)  # the replica has its weights
    client = _client(gateway)
    assert "d" in [m.id for m in client.models.list().data]
    assert client.models.retrieve("d").id == "d"

    messages = [{"role": "user", "content": "12"}]
    plain = client.chat.completions.create(model="d", messages=messages, max_tokens=8, seed=11)
    text = plain.choices[0].message.content
    assert plain.model == "d" and plain.usage.completion_tokens >= 1

    # the same seed streamed gives the same text, delta by delta
    stream = client.chat.completions.create(model="d", messages=messages, max_tokens=8, seed=11, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason

    # a stop string cuts the choice where it first occurs, streamed or not
    assert len(text) >= 2, text  # seed 11 samples 8 tokens of the tiny model without eos
    stop = text[1]
    cut = client.chat.completions.create(model="d", messages=messages, max_tokens=8, seed=11, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="d", messages=messages, max_tokens=8, seed=11, stop=stop, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]
    )

    # n=2 with log-probs: one log-prob per token of each choice, each a real log-probability
    two = client.chat.completions.create(
        model="d", messages=messages, max_tokens=4, n=2, logprobs=True, seed=5
    )
    assert len(two.choices) == 2
    for choice in two.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(t.logprob <= 0.0 for t in content)

    completion = client.completions.create(model="d", prompt="12", max_tokens=4, seed=7, logprobs=0)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    streamed = client.completions.create(model="d", prompt="12", max_tokens=4, seed=7, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text

    # OpenAI-shaped errors the client raises as its own exception types
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="d", messages=messages, max_tokens=10_000)
    assert too_long.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as top:
        client.chat.completions.create(
            model="d", messages=messages, max_tokens=2, logprobs=True, top_logprobs=3
        )
    assert top.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as penalty:
        client.chat.completions.create(model="d", messages=messages, max_tokens=2, presence_penalty=1.0)
    assert penalty.value.param == "presence_penalty"
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, key="wrong").models.list()
    # and it still serves
    assert client.completions.create(model="d", prompt="12", max_tokens=2).choices


# Every field of the official client's chat and completions requests (tests/unit/gateway/
# test_openai_fields.py reads them from the installed package and fails on one missing here): a value
# that asks for something, and what must come of it. Served: the reply shows the field's effect.
# Refused: a 400 naming the field, and nothing generated.
MESSAGES = [{"role": "user", "content": "12"}]
PROMPT = "12"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def _with_tools(reply) -> bool:
    """The prompt was the chat template's rendering with the tools (the gateway's char tokenizer:
    one token a character), and the reply is a choice (text, or calls the parser found)."""
    from services.modeling.tokenizer import CharTokenizer

    rendered = CharTokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tools=TOOLS)
    return reply.usage.prompt_tokens == len(rendered) and ok(reply)


def ok(reply) -> bool:
    return bool(reply.choices)


def refuse(value):
    return ("refused", value, None)


def serve(value, check=ok):
    return ("served", value, check)


CHAT_SENT = {
    "audio": refuse({"voice": "alloy", "format": "wav"}),
    "frequency_penalty": refuse(0.5),
    "function_call": refuse("auto"),
    "functions": refuse([{"name": "f", "parameters": {"type": "object"}}]),
    "logit_bias": refuse({"5": 10}),
    "logprobs": serve(True, lambda r: all(t.logprob <= 0 for t in r.choices[0].logprobs.content)),
    # Sent without max_tokens: OpenAI's newer name for it caps the completion.
    "max_completion_tokens": serve(
        3, lambda r: r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    ),
    "max_tokens": serve(5, lambda r: r.usage.completion_tokens == 5),
    "messages": serve(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "12"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]
    ),
    "metadata": serve({"experiment": "a"}),
    "modalities": refuse(["text", "audio"]),
    "model": serve("d", lambda r: r.model == "d"),
    "moderation": refuse({"model": "omni-moderation-latest"}),
    "n": serve(2, lambda r: len(r.choices) == 2),
    "parallel_tool_calls": serve(False, _with_tools),  # sent with tools (below)
    "prediction": refuse({"type": "content", "content": "12"}),
    "presence_penalty": refuse(0.5),
    "prompt_cache_key": serve("conversation-1"),
    "prompt_cache_options": refuse({"mode": "explicit"}),
    "prompt_cache_retention": refuse("24h"),
    "reasoning_effort": refuse("low"),
    "response_format": refuse({"type": "json_object"}),
    "safety_identifier": serve("end-user-1"),
    "seed": serve(11),
    "service_tier": refuse("flex"),
    "stop": serve(["\n"]),
    "store": refuse(True),
    "stream": serve(True),
    "stream_options": serve({"include_usage": True}),
    "temperature": serve(0.5),
    "tool_choice": serve(
        "none", _with_tools
    ),  # "required" is refused: tests/unit/gateway/test_openai_tools.py
    "tools": serve(TOOLS, _with_tools),
    "top_logprobs": refuse(2),
    "top_p": serve(0.5),
    "user": serve("end-user-1"),
    "verbosity": refuse("low"),
    "web_search_options": refuse({"search_context_size": "low"}),
}

COMPLETION_SENT = {
    "best_of": serve(3, lambda r: len(r.choices) == 1),
    "echo": serve(True, lambda r: r.choices[0].text.startswith(PROMPT)),
    "frequency_penalty": refuse(0.5),
    "logit_bias": refuse({"5": 10}),
    "logprobs": serve(0, lambda r: len(r.choices[0].logprobs.tokens) >= 1),
    "max_tokens": serve(3, lambda r: r.usage.completion_tokens <= 3),
    "model": serve("d", lambda r: r.model == "d"),
    "n": serve(2, lambda r: len(r.choices) == 2),
    "presence_penalty": refuse(0.5),
    "prompt": serve([1, 2, 3]),
    "seed": serve(7),
    "stop": serve(["\n"]),
    "stream": serve(True),
    "stream_options": serve({"include_usage": True}),
    "suffix": refuse("tail"),
    "temperature": serve(0.5),
    "top_p": serve(0.5),
    "user": serve("end-user-1"),
}


def _send(create, base: dict, field: str, value, check) -> str:
    """Send `base` with `field` set through the client's `create`; "" when it did what was expected,
    else what happened."""
    import openai

    request = {**base, field: value}
    if field == "max_completion_tokens":
        request.pop("max_tokens")
    if field == "stream_options":
        request["stream"] = True
    if field == "top_logprobs":
        request["logprobs"] = True
    if field in ("tool_choice", "parallel_tool_calls"):
        request["tools"] = TOOLS
    try:
        reply = create(**request)
    except openai.BadRequestError as exc:
        return "" if check is None and exc.param == field else f"400 {exc.param}: {exc.message}"
    if check is None:
        return "served, not refused"
    if request.get("stream"):
        chunks = list(reply)
        if field == "stream_options" and not chunks[-1].usage:
            return "no usage chunk"
        return "" if any(c.choices for c in chunks) else "nothing streamed"
    return "" if check(reply) else f"served without its effect: {reply}"


def test_every_field_of_the_official_client_is_served_or_refused_naming_it(served) -> None:
    from tests.unit.gateway.test_openai_fields import CHAT, COMPLETION, client_fields

    gateway, _config = served
    _completion(gateway)  # the replica has its weights
    client = _client(gateway)
    assert set(CHAT_SENT) == client_fields(CHAT) and set(COMPLETION_SENT) == client_fields(COMPLETION)
    base = {"model": "d", "messages": MESSAGES, "max_tokens": 8, "seed": 11}
    wrong = {
        f"chat {field}": what
        for field, (_, value, check) in CHAT_SENT.items()
        if (what := _send(client.chat.completions.create, base, field, value, check))
    }
    base = {"model": "d", "prompt": PROMPT, "max_tokens": 4, "seed": 7}
    wrong |= {
        f"completions {field}": what
        for field, (_, value, check) in COMPLETION_SENT.items()
        if (what := _send(client.completions.create, base, field, value, check))
    }
    assert wrong == {}
    # Beyond the client's types: vLLM's top_k is served, anything else is refused naming it.
    greedy = [client.completions.create(**{**base, "seed": seed}, extra_body={"top_k": 1}) for seed in (7, 8)]
    assert greedy[0].choices[0].text == greedy[1].choices[0].text  # top_k = 1: whatever the seed
    import openai

    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(**base, extra_body={"repetition_penalty": 1.2})
    assert unknown.value.param == "repetition_penalty"
