"""Tool-call and reasoning formats, one module per format, chosen from the model's chat template.

A tool format module is the prompt side of a format the Rust markup parser reads (the parser of
the same `NAME` lives in `rust/markup/`). Adding a format is a module here, its parser there and
one line in `TOOL_FORMATS`.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlxgate.formats import (
    deepseek_v3,
    glm,
    harmony,
    hermes,
    kimi_k2,
    llama3_json,
    minimax_m2,
    mistral,
    mistral_v11,
    qwen3_coder,
    seed_oss,
)
from mlxgate.formats.common import Message
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
        """The tool listing for the system message, for templates that render calls but do not
        list tools; None: mlxgate's generic listing."""
        ...

    def prepare(self, messages: list[Message]) -> list[Message]:
        """The neutral messages in the shape this format's templates read."""
        ...


# Detection order: the first whose `detect` accepts the template; Hermes is the fallback. The
# specific markers come first: GLM, Qwen3-Coder and Hermes templates all contain `<tool_call>`,
# Mistral v11 and older Mistral templates `[TOOL_CALLS]`, Seed-OSS and Qwen3-Coder `<function=`.
TOOL_FORMATS: dict[str, ToolFormat] = {
    fmt.NAME: fmt
    for fmt in (
        harmony,
        kimi_k2,
        deepseek_v3,
        minimax_m2,
        seed_oss,
        mistral_v11,
        mistral,
        glm,
        qwen3_coder,
        llama3_json,
        hermes,
    )
}
DEFAULT_TOOL_FORMAT = hermes


def detect_tool_format(template: str) -> ToolFormat:
    return next((fmt for fmt in TOOL_FORMATS.values() if fmt.detect(template)), DEFAULT_TOOL_FORMAT)
