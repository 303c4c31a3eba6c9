"""Mistral tokenizer v11+ (Devstral, Magistral, Mistral Small 3.2, Ministral 3):
`[TOOL_CALLS]NAME[ARGS]{…}`, one `[TOOL_CALLS]` per call."""

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import Message
from mlxgate.formats.common import no_tool_prompt as tool_prompt
from mlxgate.formats.mistral import tool_result

__all__ = [
    "NAME",
    "detect",
    "forced_opening",
    "prepare",
    "render_call",
    "tool_prompt",
    "tool_result",
]

NAME = "mistral_v11"


def detect(template: str) -> bool:
    return "[TOOL_CALLS]" in template and "[ARGS]" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments, ensure_ascii=False)}"


def forced_opening(name: str | None) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]" if name else "[TOOL_CALLS]"


def prepare(messages: list[Message]) -> list[Message]:
    """Mistral templates want user and answer turns to alternate, with calls and results between:
    a user turn right after tool results (Claude Code's results plus the user's words) has no
    answer before it, so its text goes with the last result."""
    out: list[Message] = []
    for message in messages:
        if message["role"] == "user" and out and out[-1]["role"] == "tool":
            last = out[-1]
            out[-1] = {**last, "content": f"{last['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out
