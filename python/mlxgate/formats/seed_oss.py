"""Seed-OSS: `<seed:tool_call><function=NAME><parameter=K>V</parameter>…</function>
</seed:tool_call>`, values as raw text."""

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

NAME = "seed_oss"


def detect(template: str) -> bool:
    return "<seed:tool_call>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>{xml_value(v)}</parameter>\n" for k, v in arguments.items())
    return f"<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>"


def forced_opening(name: str | None) -> str:
    return f"<seed:tool_call>\n<function={name}>\n" if name else "<seed:tool_call>\n<function="
