"""Tool calls in the Hermes convention: parsed as vLLM's hermes parser parses them (checked against
the pinned vLLM's source), rendered by the chat templates as Qwen2.5's template
renders them, and the Jinja copies of the templates agree with the Python rendering."""

from __future__ import annotations

import json
import re

import pytest

from services.modeling.chatml import render_chatml
from services.modeling.hf_files import CHATML_TEMPLATE, QWEN_CHAT_TEMPLATE
from services.modeling.hf_tokenizer import compile_chat_template
from services.modeling.tool_calls import (
    _TOOL_CALL,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolSchemaError,
    hermes_messages,
    normalize_tools,
    openai_tool_calls,
    parse_tool_calls,
    template_renders_tools,
    with_object_arguments,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {"name": "submit", "description": "Finish", "parameters": {"type": "object", "properties": {}}},
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ],
    [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "run_shell", "arguments": {"command": "ls"}}},
                {"type": "function", "function": {"name": "run_shell", "arguments": '{"command": "pwd"}'}},
            ],
        },
        {"role": "tool", "content": "a.py"},
        {"role": "tool", "content": "/workspace"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "submit", "arguments": {}}}],
        },
        {"role": "tool", "content": "done"},
    ],
]


def test_calls_are_found_with_the_text_before_them_as_content():
    text = (
        'I will look.\n<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
    )
    text += '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "I will look.\n" and not parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("run_shell", {"command": "ls -la"}),
        ("submit", {}),
    ]
    assert parse_tool_calls("no calls here").attempted is False


def test_an_unclosed_call_at_the_end_still_counts_as_vllm_reads_it():
    parsed = parse_tool_calls('<tool_call>\n{"name": "submit", "arguments": {}}')
    assert [c.name for c in parsed.calls] == ["submit"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("{not json", "not valid JSON"),
        ('["submit"]', "must be a JSON object"),
        ('{"arguments": {}}', "'name' must be"),
        ('{"name": "run_shell", "arguments": [1]}', "'arguments' must be a JSON object"),
    ],
)
def test_a_malformed_call_is_an_error_the_model_can_read(body, says):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert not parsed.calls and len(parsed.errors) == 1
    assert says in parsed.errors[0] and "<tool_call>" in parsed.errors[0]  # says how to write one


def test_arguments_written_as_a_json_string_are_accepted():
    (call,) = parse_tool_calls('<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>').calls
    assert call.arguments == {"a": 1}


def test_the_openai_view_is_all_calls_or_plain_content():
    content, calls = openai_tool_calls('ok <tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>')
    assert content == "ok " and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": "é"}'}
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{broken</tool_call>'
    assert openai_tool_calls(text) == (text, [])


def test_the_parser_is_vllms_hermes_parser_by_its_pinned_source():
    from tests.support.vllm_side import source

    text = source("vllm/tool_parsers/hermes_tool_parser.py")
    pattern = re.search(r'tool_call_regex = re.compile\(\s*r"(.*?)",\s*re.DOTALL', text)
    assert pattern and pattern.group(1) == _TOOL_CALL.pattern and _TOOL_CALL.flags & re.DOTALL
    assert f'tool_call_start_token: str = "{TOOL_CALL_START}"' in text
    assert f'tool_call_end_token: str = "{TOOL_CALL_END}"' in text
    # Content is what precedes the first call, None when empty; a failed JSON load gives no calls.
    assert "content = model_output[: model_output.find(self.tool_call_start_token)]" in text
    assert "content=content if content else None" in text
    assert "tools_called=False, tool_calls=[], content=model_output" in text


def test_tool_schemas_are_checked_and_named_by_field():
    assert [t["function"]["name"] for t in normalize_tools(TOOLS)] == ["run_shell", "submit"]
    with pytest.raises(ToolSchemaError, match=r"tools\[0\].function.name"):
        normalize_tools([{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ToolSchemaError, match=r"tools\[0\].type"):
        normalize_tools([{"type": "retrieval"}])
    with pytest.raises(ToolSchemaError, match=r"tools\[1\].parameters"):
        normalize_tools([TOOLS[0], {"name": "f", "parameters": "x"}])


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_jinja_templates_render_what_the_python_rendering_does(conversation, tools):
    for generation_prompt in (True, False):
        python = render_chatml(conversation, generation_prompt, tools)
        as_templates_get_them = [with_object_arguments(m) for m in conversation]
        jinja = compile_chat_template(CHATML_TEMPLATE).render(
            messages=as_templates_get_them,
            tools=normalize_tools(tools) if tools else None,
            add_generation_prompt=generation_prompt,
        )
        assert jinja == python
        # Qwen's template differs only by its default system turn.
        rewritten = hermes_messages(conversation, tools)
        if rewritten[0]["role"] != "system":
            rewritten = [{"role": "system", "content": "You are a helpful assistant."}, *rewritten]
        qwen = compile_chat_template(QWEN_CHAT_TEMPLATE).render(
            messages=as_templates_get_them,
            tools=normalize_tools(tools) if tools else None,
            add_generation_prompt=generation_prompt,
        )
        assert qwen == render_chatml(rewritten, generation_prompt)


def test_tools_render_in_the_qwen25_convention():
    text = render_chatml(CONVERSATIONS[2], True, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(normalize_tools(TOOLS)[0]) + "\n" in text
    assert (
        '<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "run_shell", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\n/workspace\n</tool_response><|im_end|>"
        in text
    )
    assert render_chatml(CONVERSATIONS[1], True) == render_chatml(
        CONVERSATIONS[1], True, None
    )  # no tools: as before


def test_templates_that_render_tools_are_recognized():
    assert template_renders_tools(QWEN_CHAT_TEMPLATE) and template_renders_tools(CHATML_TEMPLATE)
    assert not template_renders_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
