"""Mistral tokenizer v11+ (Devstral, Magistral, Mistral Small 3.2, Ministral 3):
`[TOOL_CALLS]NAME[ARGS]{…}`, one `[TOOL_CALLS]` per call."""

from __future__ import annotations

import json
from typing import Any

from mlxgate.formats.common import unchanged as prepare

__all__ = ["NAME", "detect", "forced_opening", "prepare", "render_call"]

NAME = "mistral_v11"


def detect(template: str) -> bool:
    return "[TOOL_CALLS]" in template and "[ARGS]" in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments, ensure_ascii=False)}"


def forced_opening(name: str | None) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]" if name else "[TOOL_CALLS]"
