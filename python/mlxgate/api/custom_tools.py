"""Custom (freeform) tools, OpenAI's `{"type": "custom", "name", "description", "format"}` on the
Responses API and Chat Completions: a tool whose input is raw text, free or in a grammar (Codex
declares `apply_patch` so, with a Lark grammar of its patch format).

No chat template knows such a tool, so the prompt shows it as a function of one string parameter,
`input`, described with its format: every tool format can write that call. The stream core reads
the call's input back out of the arguments (`rust/events/custom_input.rs`) and answers with a
custom tool call. The input is held to the tool's grammar by llguidance as the model writes it
(`formats/call_grammar.py`): as raw text where the tool format writes a string parameter so (the
XML-parameter formats), inside the JSON string where it writes JSON (`formats/escaped_grammar.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mlxgate import prompts
from mlxgate.api.errors import invalid
from mlxgate.engine import Grammar, GrammarError
from mlxgate.formats.call_grammar import CUSTOM_INPUT as INPUT  # the stream core reads it too


@dataclass(frozen=True)
class CustomTool:
    name: str
    # The tool's input grammar in llguidance's Lark; None: any text.
    grammar: str | None


def _grammar(format: Any, where: str, name: str) -> tuple[str | None, str]:
    """The Lark grammar of a tool's `format` and how the prompt describes the input."""
    if format is None or (isinstance(format, dict) and format.get("type", "text") == "text"):
        return None, "The tool's input: raw text, free form."
    if not isinstance(format, dict) or format.get("type") != "grammar":
        raise invalid(f"{where}.format: a custom tool's format is 'text' or 'grammar'")
    at = f"{where}.format"
    if isinstance(format.get("grammar"), dict):
        # Chat Completions declares the grammar one level down; the Responses API, flat.
        format, at = format["grammar"], f"{at}.grammar"
    syntax, definition = format.get("syntax"), format.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise invalid(f"{at}.definition: the grammar of custom tool {name!r} is empty")
    if syntax == "lark":
        grammar = definition
    elif syntax == "regex":
        grammar = "start: /" + definition.replace("/", "\\/") + "/\n"
    else:
        raise invalid(f"{at}.syntax: {syntax!r} is not 'lark' or 'regex'")
    if (error := _compile_error(grammar)) is not None:
        raise invalid(
            f"{at}.definition: the grammar of custom tool {name!r} cannot be compiled: {error}"
        )
    described = f"The tool's input: raw text in this {syntax} grammar:\n{definition.strip()}"
    return grammar, described


@functools.lru_cache(maxsize=64)
def _compile_error(grammar: str) -> str | None:
    """Why llguidance cannot compile `grammar`, if it cannot (an agent sends the same tools
    with every request: each grammar is checked once)."""
    try:
        Grammar.lark(grammar)
    except GrammarError as exc:
        return str(exc)
    return None


def custom_tool(
    name: Any, description: Any, format: Any, where: str
) -> tuple[prompts.Tool, CustomTool]:
    """The function the prompt shows for a custom tool, and the tool as the reply reads it."""
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name: a custom tool needs a name")
    grammar, described = _grammar(format, where, name)
    parameters = {
        "type": "object",
        "properties": {INPUT: {"type": "string", "description": described}},
        "required": [INPUT],
    }
    spec = {"name": name, "description": description or "", "parameters": parameters}
    return {"type": "function", "function": spec}, CustomTool(name, grammar)


def call(call_id: str | None, name: str, input: str) -> dict[str, Any]:
    """An earlier custom tool call as the template renders calls."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": {INPUT: input}},
    }


def grammars(tools: list[CustomTool]) -> dict[str, str]:
    """Each custom tool's grammar, by tool name (the tools with a grammar)."""
    return {tool.name: tool.grammar for tool in tools if tool.grammar is not None}
