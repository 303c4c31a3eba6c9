"""What several formats share: the JSON call opening, XML parameter values, message pass-through."""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


def json_call_opening(name: str | None) -> str:
    """The call object up to its arguments (a named tool), or up to the name (any tool)."""
    return f'{{"name": {json.dumps(name)}, "arguments": ' if name else '{"name": "'


def xml_value(value: Any) -> str:
    """A parameter value as the XML formats write it: strings raw, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def unchanged(messages: list[Message]) -> list[Message]:
    """The messages as the template takes them (most templates read the neutral shape as is)."""
    return messages


def no_tool_prompt(tools: list[dict[str, Any]]) -> str | None:
    """No tool listing of the format's own: mlxgate's generic one is used where needed."""
    return None
