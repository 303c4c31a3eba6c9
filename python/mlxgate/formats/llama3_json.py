"""Llama 3.1+ JSON tool calling: a reply that starts with `{"name": …, "parameters": {…}}`."""

from __future__ import annotations

from mlxgate.formats.common import json_call as render_call
from mlxgate.formats.common import json_call_opening as forced_opening
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
