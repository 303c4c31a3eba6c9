"""Tool-call and reasoning formats, one module per format, chosen from the model's chat template.

A tool format module is the prompt side of a format the Rust markup parser reads (the parser of
the same `NAME` lives in `rust/markup/`). Adding a format is a module here, its parser there and
one line in `TOOL_FORMATS`.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlxgate.formats import hermes, llama3_json, mistral


class ToolFormat(Protocol):
    """What a format module provides (modules satisfy this protocol)."""

    NAME: str

    def detect(self, template: str) -> bool:
        """Whether a chat template writes tool calls this way."""
        ...

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """An earlier assistant call, for templates that do not render tool calls themselves."""
        ...

    def forced_opening(self, name: str | None) -> str:
        """The start of a call the prompt forces: of tool `name`, or of any tool (None)."""
        ...


# Detection order: the first whose `detect` accepts the template; Hermes is the fallback.
TOOL_FORMATS: dict[str, ToolFormat] = {fmt.NAME: fmt for fmt in (mistral, llama3_json, hermes)}
DEFAULT_TOOL_FORMAT = hermes

THINK_TAGS = ("<think>", "</think>")


def detect_tool_format(template: str) -> ToolFormat:
    return next((fmt for fmt in TOOL_FORMATS.values() if fmt.detect(template)), DEFAULT_TOOL_FORMAT)


def detect_reasoning(template: str) -> tuple[str, str] | None:
    """The tags a template's model reasons in, if any."""
    return THINK_TAGS if THINK_TAGS[0] in template else None
