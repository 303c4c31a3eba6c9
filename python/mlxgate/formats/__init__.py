"""Tool-call and reasoning formats, one module per format, chosen from the model's chat template.

A tool format module is the prompt side of a format the Rust markup parser reads: the parser of
the same name lives in `rust/markup/`, whose registry is the one list of formats (and the order
templates are matched in). Adding a format is a module here and its parser, with its line in
the registry, there.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, cast

from mlxgate._native import Markup
from mlxgate.formats.common import Message, call_example, listed_tools
from mlxgate.formats.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    detect_reasoning_format,
)

__all__ = [
    "REASONING_FORMATS",
    "TOOL_FORMATS",
    "ReasoningFormat",
    "ToolFormat",
    "detect_reasoning_format",
    "detect_tool_format",
]


class ToolFormat(Protocol):
    """What a format module provides (modules satisfy this protocol)."""

    NAME: str

    def detect(self, template: str) -> bool:
        """Whether a chat template writes tool calls this way."""
        ...

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it; also an earlier call, for templates that do not
        render tool calls themselves."""
        ...

    def forced_opening(self, name: str | None) -> str:
        """The start of a call the prompt forces: of tool `name`, or of any tool (None)."""
        ...

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str | None:
        """The format's own tool listing for the system message, and how to call one, for
        templates that do not list tools; None: the common listing (`listed_tools`) with an
        example call in the format's markup."""
        ...

    def tool_result(self, content: str) -> str:
        """A tool's result as a user turn, for templates that know nothing of tools."""
        ...

    def prepare(self, messages: list[Message]) -> list[Message]:
        """The neutral messages in the shape this format's templates read."""
        ...


# In the order templates are matched: the first whose `detect` accepts one; Hermes (the last)
# is the fallback.
TOOL_FORMATS: dict[str, ToolFormat] = {
    name: cast(ToolFormat, importlib.import_module(f"{__name__}.{name}"))
    for name in Markup.tool_formats()
}
DEFAULT_TOOL_FORMAT = TOOL_FORMATS["hermes"]


def tool_prompt(fmt: ToolFormat, tools: list[dict[str, Any]]) -> str:
    """The tool listing a template that does not list tools gets, in `fmt`'s words."""
    return fmt.tool_prompt(tools) or listed_tools(tools, call_example(fmt.render_call))


def detect_tool_format(template: str) -> ToolFormat:
    return next((fmt for fmt in TOOL_FORMATS.values() if fmt.detect(template)), DEFAULT_TOOL_FORMAT)
