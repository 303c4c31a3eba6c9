"""Qwen3-Coder, Qwen3.5: `<tool_call><function=NAME><parameter=KEY>value</parameter>…</function>
</tool_call>`, values as raw text (the parser types them by the tool's schema)."""

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

NAME = "qwen3_coder"


def detect(template: str) -> bool:
    return "<tool_call>" in template and "<function=" in template and "<parameter=" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(
        f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def forced_opening(name: str | None) -> str:
    return f"<tool_call>\n<function={name}>\n" if name else "<tool_call>\n<function="
