"""DeepSeek V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}
<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` (V3.2's DSML markup is another format, not this one)."""

# ruff: noqa: RUF001, RUF002 (DeepSeek's tags are written with fullwidth bars)

from __future__ import annotations

import json
from typing import Any

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

NAME = "deepseek_v3"
CALLS, CALL, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"


def detect(template: str) -> bool:
    return CALLS in template and SEP in template and "DSML" not in template


def render_call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps(arguments, ensure_ascii=False)
    return f"{CALLS}{CALL}{name}{SEP}{body}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


def forced_opening(name: str | None) -> str:
    return f"{CALLS}{CALL}{name}{SEP}" if name else f"{CALLS}{CALL}"


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool listing DeepSeek's model card documents for the system prompt (the V3.1
    template renders calls and results but not the tools)."""
    listing = "".join(
        f"### {t['function']['name']}\nDescription: {t['function'].get('description', '')}\n\n"
        f"Parameters: {json.dumps(t['function'].get('parameters', {}), ensure_ascii=False)}\n\n"
        for t in tools
    )
    return (
        f"## Tools\nYou have access to the following tools:\n\n{listing}"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{CALLS}{CALL}tool_call_name{SEP}tool_call_arguments<｜tool▁call▁end｜>"
        "{additional_tool_calls}<｜tool▁calls▁end｜>\n\n"
        "Where:\n\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
        "Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces"
    )
