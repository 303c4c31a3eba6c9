"""Hermes / Qwen 2.5 / Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import json_call_opening
from mlxgate.formats.common import no_tool_prompt as tool_prompt
from mlxgate.formats.common import unchanged as prepare

__all__ = ["NAME", "detect", "forced_opening", "prepare", "render_call", "tool_prompt"]

NAME = "hermes"


def detect(template: str) -> bool:
    return "<tool_call>" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def forced_opening(name: str | None) -> str:
    return f"<tool_call>\n{json_call_opening(name)}"
