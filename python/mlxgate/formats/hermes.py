"""Hermes / Qwen 2.5 / Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`."""

from __future__ import annotations

from typing import Any

from mlxgate.formats.common import json_call, json_call_opening, listed_tools
from mlxgate.formats.common import tool_response as tool_result
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

NAME = "hermes"


def detect(template: str) -> bool:
    return "<tool_call>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json_call(name, arguments)}\n</tool_call>"


def forced_opening(name: str | None) -> str:
    return f"<tool_call>\n{json_call_opening(name)}"


# The Hermes / Qwen 2.5 convention, which small instruction-tuned models follow best.
HOW_TO_CALL = """For each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    return listed_tools(tools, HOW_TO_CALL)
