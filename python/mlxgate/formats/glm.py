"""GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`
(4.5 and 4.6 put a newline before each key and value tag, 4.7 none)."""

from __future__ import annotations

from typing import Any

from mlxgate.formats.common import no_tool_prompt as tool_prompt
from mlxgate.formats.common import tool_response as tool_result
from mlxgate.formats.common import unchanged as prepare
from mlxgate.formats.common import xml_value

__all__ = [
    "NAME",
    "detect",
    "forced_opening",
    "prepare",
    "render_call",
    "tool_prompt",
    "tool_result",
]

NAME = "glm"


def detect(template: str) -> bool:
    return "<arg_key>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def forced_opening(name: str | None) -> str:
    # The model writes the separator after the name itself (a newline in 4.5/4.6, none in 4.7).
    return f"<tool_call>{name}" if name else "<tool_call>"
