"""What several formats share: the JSON call object and its opening, XML parameter values, message
pass-through, the tool listing and tool results for templates that render neither."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]


def json_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the JSON object Hermes, Llama 3 and Mistral write (alone, in tags, in a list)."""
    return json.dumps({"name": name, "arguments": arguments})


def json_call_opening(name: str | None) -> str:
    """The call object up to its arguments (a named tool), or up to the name (any tool)."""
    return f'{{"name": {json.dumps(name)}, "arguments": ' if name else '{"name": "'


def xml_value(value: Any) -> str:
    """A parameter value as the XML formats write it: strings raw, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def unchanged(messages: list[Message]) -> list[Message]:
    """The messages as the template takes them (most templates read the neutral shape as is)."""
    return messages


def listed_tools(tools: list[dict[str, Any]], how_to_call: str) -> str:
    """The tools listed for the system message of a template that does not list them, and how
    to call one (in the format's own markup)."""
    listing = "\n".join(json.dumps(tool) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n{how_to_call}"
    )


def no_tool_prompt(tools: list[dict[str, Any]]) -> str | None:
    """No tool listing of the format's own: the common one, with a call in its markup."""
    return None


def call_example(render_call: Callable[[str, dict[str, Any]], str]) -> str:
    """How to call a tool, shown by an example call in the format's markup."""
    example = render_call("function_name", {"argument": "value"})
    return f"For each function call, write it exactly as in this example:\n{example}"


def tool_response(content: str) -> str:
    """A tool's result as a user turn, for a template that knows nothing of tools (the Hermes
    convention most formats' models read)."""
    return f"<tool_response>\n{content}\n</tool_response>"
