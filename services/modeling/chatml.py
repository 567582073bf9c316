"""ChatML, the chat format of the shipped tokenizer and the fallback of a tokenizer directory that
ships no chat template: its special tokens and how a conversation renders as text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.modeling.tool_calls import hermes_messages, needs_rewrite

PAD, EOT, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def render_chatml(
    messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """ChatML text: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant header.
    With tools, tool calls or tool results, the conversation is first written in the Hermes
    convention (services/modeling/tool_calls.py), as Qwen2.5's template renders it."""
    if tools or needs_rewrite(messages):
        messages = hermes_messages(messages, tools)
    parts = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"messages[{i}]: needs string 'role' and 'content'")
        parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def continuation_text(
    render: Callable[[list[dict[str, Any]], bool], str],
    previous: list[dict[str, str]],
    new: list[dict[str, str]],
    turn_end: str,
    add_generation_prompt: bool = True,
) -> str:
    """The chat text that follows the model's last turn (which ended with `turn_end`, its eos token)
    when `new` messages are appended, so a multi-turn episode extends the token ids it already has
    instead of re-rendering (a template's first-message preamble, like Qwen's default system
    turn, is rendered once)."""
    before = render(previous, False)
    full = render([*previous, *new], add_generation_prompt)
    end = before.rfind(turn_end)
    if end < 0 or not full.startswith(before[: end + len(turn_end)]):
        raise ValueError("chat template: appending messages does not extend the conversation's text")
    return full[end + len(turn_end) :]
