"""The grammar of a forced tool call: what the model may write after the opening the prompt
forces (`tool_choice` any or a named tool), so that the arguments it writes validate against the
tool's schema and the call closes as its format closes it.

Derived from the format's own `forced_opening` and `render_call`, so every format gets it where
its calls have one of two shapes: arguments as one JSON object (Hermes, Llama 3, DeepSeek,
harmony, Kimi K2, ...), held to the schema by llguidance's JSON-schema support; or arguments as XML
parameters (Qwen3-Coder, GLM, MiniMax, Seed-OSS), each a key the schema names with a value that
is raw text for a string and the property's JSON otherwise. Grammars are llguidance's Lark.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlxgate.formats import ToolFormat

# The separators `json.dumps` writes and templates render arguments with: the model's habit.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
PROBE_KEY, PROBE_VALUE = "mlxgate_probe_key", "mlxgate_probe_value"

Literal = Callable[[str], str]  # text -> a Lark expression matching exactly it


def forced_call(
    fmt: ToolFormat, tools: list[dict[str, Any]], name: str | None, literal: Literal
) -> str | None:
    """The Lark grammar for the rest of a forced call to `name` (None: to any of `tools`);
    None where the format's calls have neither shape."""
    opening = fmt.forced_opening(name)
    alternatives, rules = [], []
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    for index, function in enumerate(chosen):
        schema = function.get("parameters") or {"type": "object"}
        head = fmt.forced_opening(function["name"])
        empty = fmt.render_call(function["name"], {})
        if not (head.startswith(opening) and empty.startswith(head)):
            return None
        rest = empty[len(head) :]
        rule = f"arguments{index}"
        before = ""  # between the opening and the arguments
        if "{}" in rest:
            before, closing = rest.split("{}", 1)
            rules.append(f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}")
        else:
            closing = rest
            parameters = _xml_parameters(fmt, function["name"], head, rest, schema, rule, literal)
            if parameters is None:
                return None
            rules.extend(parameters)
            rule = rule if parameters else ""  # a tool without parameters
        # Kimi K2 numbers its calls: the model writes the number right after the opening.
        number = re.match("[0-9]+", before)
        parts = [
            literal(head[len(opening) :]),
            "/[0-9]+/" if number else "",
            literal(before[number.end() :] if number else before),
            rule,
            literal(closing),
        ]
        alternatives.append(" ".join(part for part in parts if part))
    if not alternatives:
        return None
    return "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n"


def optional_calls(
    fmt: ToolFormat, tools: list[dict[str, Any]], literal: Literal, specials: list[int]
) -> str | None:
    """The Lark grammar for a reply that may call tools (`strict` tools, `tool_choice` auto):
    any text, and each call it makes held to its tool's schema as a forced call is. `specials`
    are the tokenizer's added tokens (a reasoning model's think tags, ...), which free text may
    hold. None where forced calls have no grammar, and for harmony, whose call opening
    `<|channel|>` also opens its answer."""
    call = forced_call(fmt, tools, None, literal)
    opening = fmt.forced_opening(None)
    if call is None or fmt.NAME == "harmony":
        return None
    rules = call.replace("start:", "call_rest:", 1)
    opener = literal(opening)
    if opener.startswith("<["):
        # The call opens with a token no text spells: text is anything up to that token.
        first = opener[2 : opener.index("]>")]
        others = " | ".join(f"<[{i}]>" for i in specials if str(i) != first)
        return (
            "start: free (call free)*\n"
            f"free: (TEXT{' | ' + others if others else ''})*\n"
            "TEXT: /(?s:.+)/\n"
            f"call: {opener} call_rest\n" + rules
        )
    pattern = "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in opening)
    return (
        "start: (prose call_rest)* TAIL\n"
        # Text up to a call's opening (which the model writes: the call's rules continue it).
        f"prose[stop={json.dumps(opening)}]: /(?s:.*)/\n"
        # The text after the last call, or all of it: anything that opens no call.
        f"TAIL: /(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/\n" + rules
    )


def _xml_parameters(
    fmt: ToolFormat,
    name: str,
    head: str,
    rest: str,
    schema: dict[str, Any],
    rule: str,
    literal: Literal,
) -> list[str] | None:
    """Rules for the parameters (`rule` first), for a format that writes each parameter as
    `before KEY between VALUE after` (learned from a probe call): the schema's properties in its
    order, the required ones always; a string's value raw text up to `after`, which the model
    writes as the stop string; any other value the property's JSON."""

    def parameters(arguments: dict[str, str]) -> str | None:
        call = fmt.render_call(name, arguments)
        if not (call.startswith(head) and call.endswith(rest)):
            return None
        return call[len(head) : len(call) - len(rest)]

    one = parameters({PROBE_KEY: PROBE_VALUE})
    two = parameters({PROBE_KEY: PROBE_VALUE, PROBE_KEY + "2": PROBE_VALUE + "2"})
    if one is None or two != one + one.replace(PROBE_KEY, PROBE_KEY + "2").replace(
        PROBE_VALUE, PROBE_VALUE + "2"
    ):
        return None  # not one self-contained piece per parameter (a JSON object is not)
    if one.count(PROBE_KEY) != 1 or one.count(PROBE_VALUE) != 1:
        return None
    before, after_key = one.split(PROBE_KEY)
    if PROBE_VALUE not in after_key:
        return None  # the value before the key
    between, after = after_key.split(PROBE_VALUE)
    if not after:
        return None
    required = set(schema.get("required") or [])
    items, values = [], []
    for position, (key, spec) in enumerate((schema.get("properties") or {}).items()):
        value = f"{rule}_{position}"
        if isinstance(spec, dict) and spec.get("type") == "string" and "enum" not in spec:
            values.append(f"{value}[stop={json.dumps(after)}]: /(?s:.*)/")
            item = f"{literal(before + key + between)} {value}"
        else:
            values.append(f"{value}: %json {json.dumps({**spec, 'x-guidance': JSON_STYLE})}")
            item = f"{literal(before + key + between)} {value} {literal(after)}"
        items.append(f"({item})" if key in required else f"({item})?")
    return [f"{rule}: {' '.join(items)}", *values] if items else []
