"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls`
read and checked, past calls and tool results in `messages` checked, and the model's calls parsed
out of its reply into the choice's `tool_calls`, as vLLM's server answers with its hermes parser.

The tools are rendered by the run's chat template (a template that reads `tools`, Qwen2.5's, gets
them as they are; one that does not, the shipped ChatML, gets them in the Hermes convention); the
reply is parsed by services/modeling/tool_calls.py, the parser the repo environment trains with, so
the calls an agent framework gets from the endpoint are the calls the policy learned to write.
`tool_choice` "auto" (the default with tools) parses, "none" renders the tools and parses nothing;
"required" and a named function are refused: they need decoding constrained to the tools' schemas,
which the engines do not do. `parallel_tool_calls: false` keeps the first call, as vLLM does. A
reply whose calls are not all well-formed is plain content (vLLM's hermes behaviour), and
finish_reason is "tool_calls" only when calls were parsed from a reply that ended by itself (a
`length` cut stays visible).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.kit.rpc.errors import InvalidArgument
from services.modeling.tool_calls import TOOL_CALL_START, ToolSchemaError, normalize_tools, openai_tool_calls

MAX_TOOLS = 128  # OpenAI's limit
_CONSTRAINED = (
    "is not served: it needs decoding constrained to the tools' schemas, which the engines do not do; "
    "use 'auto' (the model decides) or 'none'"
)


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools: those the template renders (None: none), whether the
    reply's calls are parsed into `tool_calls`, and whether more than one call is kept."""

    tools: list[dict[str, Any]] | None = None
    parse: bool = False
    parallel: bool = True

    @classmethod
    def of(cls, body: dict) -> ToolUse:
        """The request's tool fields, checked; InvalidArgument names the first bad one."""
        tools = body.get("tools")
        if tools is not None:
            if isinstance(tools, list) and len(tools) > MAX_TOOLS:
                raise InvalidArgument(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
            try:
                tools = normalize_tools(tools) or None
            except ToolSchemaError as exc:
                raise InvalidArgument(str(exc)) from None
        choice = body.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, dict) or choice == "required":
            what = "'required'" if choice == "required" else "a named function"
            raise InvalidArgument(f"tool_choice: {what} {_CONSTRAINED}")
        if choice not in ("auto", "none"):
            raise InvalidArgument(f"tool_choice: must be 'auto' or 'none', got {choice!r}")
        if choice == "auto" and not tools:
            raise InvalidArgument("tool_choice: 'auto' needs tools to choose from (set tools)")
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise InvalidArgument(f"parallel_tool_calls: must be a boolean, got {parallel!r}")
        return cls(tools, choice == "auto", parallel is not False)

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The choice's message and finish_reason for the reply `text` that ended with `finish`."""
        if not self.parse:
            return {"role": "assistant", "content": text}, finish
        content, calls = openai_tool_calls(text)
        if not self.parallel:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, finish
        message["tool_calls"] = calls
        return message, "tool_calls" if finish == "stop" else finish

    def final_delta(self, text: str, sent: int, finish: str) -> tuple[dict[str, Any], str] | None:
        """The last streamed delta of a reply that made tool calls (the content before its first
        call not yet sent, then the calls) and its finish_reason; None when it made none (what is
        left of it streams as content)."""
        message, finish = self.message(text, finish)
        calls = message.get("tool_calls")
        if not calls:
            return None
        delta: dict[str, Any] = {}
        if rest := (message["content"] or "")[sent:]:
            delta["content"] = rest
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return delta, finish

    def streamable(self, text: str) -> int:
        """How much of a reply being streamed may go out as content: all of it without parsing, else
        up to its first `<tool_call>` (or a tail that may begin one); what follows goes out parsed
        when the reply ends."""
        if not self.parse:
            return len(text)
        at = text.find(TOOL_CALL_START)
        if at >= 0:
            return at
        for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALL_START[:k]):
                return len(text) - k
        return len(text)


def assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's past `tool_calls`, checked, with each call's arguments as the object
    chat templates read (OpenAI clients send them as a JSON string)."""
    if not isinstance(calls, list):
        raise InvalidArgument(f"{where}: must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise InvalidArgument(f"{at}.type: only 'function' calls are served")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{at}.function.name: must be a string")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{at}.function.arguments: not valid JSON ({exc.msg})") from None
        if not isinstance(arguments, dict):
            raise InvalidArgument(f"{at}.function.arguments: must be a JSON object")
        out.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


NO_TOOLS = ToolUse()
