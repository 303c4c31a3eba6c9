"""MiniMax M2: `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>…</invoke>
</minimax:tool_call>`, values as raw text."""

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

NAME = "minimax_m2"


def detect(template: str) -> bool:
    return "<minimax:tool_call>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(
        f'<parameter name="{k}">{xml_value(v)}</parameter>\n' for k, v in arguments.items()
    )
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'


def forced_opening(name: str | None) -> str:
    return (
        f'<minimax:tool_call>\n<invoke name="{name}">\n'
        if name
        else '<minimax:tool_call>\n<invoke name="'
    )
