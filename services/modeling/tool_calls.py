"""Tool calls in the Hermes convention: what Qwen2.5/Qwen3, Hermes and their fine-tunes were trained on.

A model is shown its tools in the system turn, as one JSON function schema per line inside
`<tools></tools>`, and calls one by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
in its reply; each result comes back as `<tool_response>\\n...\\n</tool_response>` in a user turn
(consecutive results share one). This module is that convention written once, for everyone who
needs it:

- `parse_tool_calls(text)` finds the calls in a model's reply as vLLM's hermes tool parser does
  (`<tool_call>(.*?)</tool_call>`, or an unclosed `<tool_call>` running to the end of the text),
  and reports each malformed call as a message the model can read;
- `openai_tool_calls(text)` is the OpenAI endpoint's view of the same parse (vLLM's behaviour: one
  malformed call and the whole reply is plain content);
- `hermes_messages(messages, tools)` rewrites a conversation with tools, tool calls and tool
  results into plain role/content turns in that convention, for chat templates that render no
  tools themselves (the shipped ChatML tokenizer, a template without `tools`); templates that do
  (Qwen2.5's) receive `tools` and the messages as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
CALL_FORMAT_HINT = 'Write each call as <tool_call>\n{"name": <tool-name>, "arguments": {...}}\n</tool_call>.'


class ToolSchemaError(ValueError):
    """A tool definition that is not an OpenAI function schema; the message names the field."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI chat completion's `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedReply:
    """A model reply split into its text before the first call, its well-formed calls, and one
    readable error per malformed call."""

    content: str
    calls: list[ToolCall]
    errors: list[str]

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


def _call_from(body: str, index: int) -> ToolCall | str:
    """One `<tool_call>` block's body as a ToolCall, or the error the model reads."""
    where = f"tool call {index + 1}"
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as exc:
        return (
            f"{where}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}). {CALL_FORMAT_HINT}"
        )
    if not isinstance(raw, dict):
        return f"{where}: must be a JSON object with 'name' and 'arguments'. {CALL_FORMAT_HINT}"
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: 'name' must be the tool's name as a string. {CALL_FORMAT_HINT}"
    arguments = raw.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"{where} ({name}): 'arguments' must be a JSON object. {CALL_FORMAT_HINT}"
    if not isinstance(arguments, dict):
        return f"{where} ({name}): 'arguments' must be a JSON object. {CALL_FORMAT_HINT}"
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedReply:
    """The calls in `text`, in order; a reply without `<tool_call>` has none and no errors."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedReply(text, [], [])
    calls: list[ToolCall] = []
    errors: list[str] = []
    for index, match in enumerate(_TOOL_CALL.finditer(text)):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        parsed = _call_from(body.strip(), index)
        if isinstance(parsed, str):
            errors.append(parsed)
        else:
            calls.append(parsed)
    return ParsedReply(text[:start], calls, errors)


def openai_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a chat completion as vLLM's hermes parser answers: any malformed call
    and the whole text is content with no calls; otherwise the text before the first call (None when
    empty) and every call."""
    parsed = parse_tool_calls(text)
    if not parsed.calls or parsed.errors:
        return text, []
    return (parsed.content or None), [call.openai() for call in parsed.calls]


def normalize_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """OpenAI function tools ({"type": "function", "function": {...}}, or the bare function object)
    checked and in the OpenAI form templates expect; ToolSchemaError names the bad field."""
    if not isinstance(tools, list):
        raise ToolSchemaError(f"{where}: must be a list of tool definitions")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ToolSchemaError(f"{where}[{i}]: must be an object")
        if "function" in tool or "type" in tool:
            if tool.get("type", "function") != "function":
                raise ToolSchemaError(f"{where}[{i}].type: only 'function' tools are supported")
            function = tool.get("function")
            prefix = f"{where}[{i}].function"
        else:
            function, prefix = tool, f"{where}[{i}]"
        if not isinstance(function, dict):
            raise ToolSchemaError(f"{prefix}: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolSchemaError(f"{prefix}.name: must be 1-64 letters, digits, '_', '.' or '-'")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolSchemaError(f"{prefix}.parameters: must be a JSON schema object")
        if "description" in function and not isinstance(function["description"], str):
            raise ToolSchemaError(f"{prefix}.description: must be a string")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in normalize_tools(tools)]


def tools_system_content(tools: list[dict[str, Any]], system: str | None = None) -> str:
    """The system turn's text with the tools block, as Qwen2.5's template writes it."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in normalize_tools(tools))
    return (DEFAULT_SYSTEM if system is None else system) + TOOLS_PREAMBLE + lines + TOOLS_POSTAMBLE


def render_tool_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (Qwen2.5's template renders past calls the same way)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def _call_parts(call: Any) -> tuple[str, Any]:
    function = call.get("function", call) if isinstance(call, dict) else {}
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_calls: each call needs a function name")
    return name, function.get("arguments", {})


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Plain role/content turns of a conversation with tools (see the module docstring): the tools
    block joins the system turn (a default one when the conversation has none), an assistant turn's
    tool_calls follow its content, and each run of `tool` results becomes one user turn."""
    out: list[dict[str, Any]] = []
    rest = list(messages)
    if tools:
        system = None
        if rest and rest[0].get("role") == "system":
            system = rest.pop(0).get("content") or ""
        out.append({"role": "system", "content": tools_system_content(tools, system)})
    for i, message in enumerate(rest):
        role = message.get("role")
        content = message.get("content")
        if role == "tool":
            block = f"<tool_response>\n{content if content is not None else ''}\n</tool_response>"
            if i > 0 and rest[i - 1].get("role") == "tool":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [render_tool_call(*_call_parts(call)) for call in message["tool_calls"]]
            text = content or ""
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + "\n".join(calls)})
        else:
            out.append({"role": role, "content": content})
    return out


def with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message as templates expect it: each tool call's arguments as an object, as transformers
    documents them (OpenAI clients send them as a JSON string)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
            except json.JSONDecodeError:
                pass
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def needs_rewrite(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool results or tool calls a plain template cannot render."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_renders_tools(template: str) -> bool:
    """Whether a Jinja chat template reads `tools` (Qwen2.5's and Hermes' do; a plain ChatML one does not)."""
    return re.search(r"\btools\b", template) is not None
