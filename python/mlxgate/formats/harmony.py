"""gpt-oss (OpenAI harmony): a call is a `commentary` message to `functions.NAME`,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>`; reasoning is
the `analysis` channel, the answer the `final` channel (one format for both: the parser reads
channels)."""

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import Message
from mlxgate.formats.common import no_tool_prompt as tool_prompt
from mlxgate.formats.common import tool_response as tool_result

__all__ = [
    "NAME",
    "detect",
    "forced_opening",
    "prepare",
    "render_call",
    "tool_prompt",
    "tool_result",
]

NAME = "harmony"


def detect(template: str) -> bool:
    return "<|channel|>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps(arguments, ensure_ascii=False)
    return f"{forced_opening(name)}{body}<|call|>"


def forced_opening(name: str | None) -> str:
    if name is None:
        return "<|channel|>commentary to=functions."
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


def prepare(messages: list[Message]) -> list[Message]:
    """The gpt-oss template's shape: reasoning in `thinking`, one call per assistant message, each
    followed by its result (harmony calls one tool at a time and the template renders only the
    first call of a message). A call's analysis is its `thinking`; the template refuses text
    beside it, so text said alongside reasoning is dropped, and text alone stands in for it."""
    out: list[Message] = []
    pending: list[Message] = []  # split-off calls still to place, each after the last result
    for message in messages:
        if message["role"] != "tool" and pending:
            out.extend(pending)
            pending = []
        if message["role"] != "assistant":
            out.append(message)
            if message["role"] == "tool" and pending:
                out.append(pending.pop(0))
            continue
        turn = {k: v for k, v in message.items() if k != "reasoning_content"}
        thinking = message.get("reasoning_content") or ""
        calls = message.get("tool_calls") or []
        if not calls:
            out.append({**turn, "thinking": thinking} if thinking else turn)
            continue
        analysis = thinking or turn.get("content") or ""
        first: Message = {"role": "assistant", "content": "", "tool_calls": calls[:1]}
        out.append({**first, "thinking": analysis} if analysis else first)
        pending = [{"role": "assistant", "content": "", "tool_calls": [c]} for c in calls[1:]]
    return out + pending
