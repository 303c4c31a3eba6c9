"""Llama 3.1+ JSON tool calling: a reply that starts with `{"name": …, "parameters": {…}}`."""

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import json_call_opening
from mlxgate.formats.common import no_tool_prompt as tool_prompt
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

NAME = "llama3_json"


def detect(template: str) -> bool:
    return "<|python_tag|>" in template or "ipython" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def forced_opening(name: str | None) -> str:
    return json_call_opening(name)
