"""Mistral before tokenizer v11: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`."""

from __future__ import annotations

from typing import Any

from mlxgate.formats.common import json_call, json_call_opening
from mlxgate.formats.common import no_tool_prompt as tool_prompt
from mlxgate.formats.common import unchanged as prepare

__all__ = [
    "NAME",
    "detect",
    "forced_opening",
    "prepare",
    "render_call",
    "tool_prompt",
    "tool_result",
]

NAME = "mistral"


def detect(template: str) -> bool:
    return "[TOOL_CALLS]" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"[TOOL_CALLS][{json_call(name, arguments)}]"


def forced_opening(name: str | None) -> str:
    return f"[TOOL_CALLS][{json_call_opening(name)}"


def tool_result(content: str) -> str:
    return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"
