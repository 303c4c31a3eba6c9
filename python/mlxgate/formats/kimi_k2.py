"""Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; IDX counts the
conversation's calls (the template numbers them the same way)."""

from __future__ import annotations

import json
from typing import Any

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

NAME = "kimi_k2"
SECTION = "<|tool_calls_section_begin|>"


def detect(template: str) -> bool:
    return SECTION in template


def render_call(name: str, arguments: dict[str, Any], index: int = 0) -> str:
    return (
        f"{SECTION}<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
        f"{json.dumps(arguments, ensure_ascii=False)}<|tool_call_end|><|tool_calls_section_end|>"
    )


def forced_opening(name: str | None) -> str:
    # The model writes the call's index after the colon.
    return (
        f"{SECTION}<|tool_call_begin|>functions.{name}:"
        if name
        else f"{SECTION}<|tool_call_begin|>functions."
    )
