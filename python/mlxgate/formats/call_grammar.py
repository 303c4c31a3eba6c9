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

import functools
import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer

from mlxgate.formats import ToolFormat
from mlxgate.formats.escaped_grammar import escaped

# The separators `json.dumps` writes and templates render arguments with: the model's habit.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
PROBE_KEY, PROBE_VALUE = "mlxgate_probe_key", "mlxgate_probe_value"
# The one parameter of the function a custom tool is shown as (api/custom_tools.py), whose value
# is the tool's raw input.
CUSTOM_INPUT = "input"


@dataclass(frozen=True)
class AddedTokens:
    """The tokenizer's added tokens (`<tool_call>`, `<|call|>`, think tags, `special` or not):
    llguidance matches each only as that token, never as text, so a grammar names them by id."""

    ids: dict[str, int]  # text -> token id

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> AddedTokens:
        added = tokenizer.get_added_tokens_decoder()
        return cls({token.content: i for i, token in added.items() if len(token.content) > 1})

    @cached_property
    def _split(self) -> re.Pattern[str] | None:
        longest_first = sorted(self.ids, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self.ids else None

    def literal(self, text: str) -> str:
        """A Lark expression for exactly `text`, its added tokens as the tokens themselves (a
        string literal would make the model spell `<|call|>` out of ordinary tokens)."""
        parts = self._split.split(text) if self._split else [text]
        return " ".join(
            f"<[{self.ids[part]}]>" if part in self.ids else json.dumps(part)
            for part in parts
            if part
        )

    def leading(self, text: str) -> int | None:
        """The added token `text` starts with, if it starts with one."""
        parts = self._split.split(text, maxsplit=1) if self._split else [text]
        return self.ids[parts[1]] if len(parts) > 1 and not parts[0] else None


def forced_call(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    name: str | None,
    tokens: AddedTokens,
    inputs: dict[str, str] | None = None,
) -> str | None:
    """The Lark grammar for the rest of a forced call to `name` (None: to any of `tools`);
    None where the format's calls have neither shape. `inputs` are custom tools' grammars (by
    tool name) for their one string parameter, held where the format writes it as raw text."""
    literal = tokens.literal
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
        grammar = (inputs or {}).get(function["name"])
        if "{}" in rest:
            before, closing = rest.split("{}", 1)
            in_json = _escaped(grammar) if grammar else None
            if in_json is not None:
                # A custom tool's input in a JSON string, its grammar held through the escaping.
                opened, closed = literal(json.dumps({CUSTOM_INPUT: ""})[:-2]), literal('"}')
                rules.append(f"{rule}: {opened} {rule}_input {closed}")
                rules.append(f"{rule}_input: %lark {{\n{in_json}}}")
            else:
                rules.append(f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}")
        else:
            closing = rest
            parameters = _xml_parameters(
                fmt, function["name"], head, rest, schema, rule, tokens, grammar
            )
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


@functools.lru_cache(maxsize=64)
def _escaped(grammar: str) -> str | None:
    """A custom tool's grammar as it is written in a JSON string (the same few grammars come
    with every request of an agent)."""
    return escaped(grammar)


def optional_calls(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    tokens: AddedTokens,
    inputs: dict[str, str] | None = None,
) -> str | None:
    """The Lark grammar for a reply that may call tools (`strict` tools, custom tools with a
    grammar, `tool_choice` auto): any text, and each call it makes held to its tool's schema (or
    grammar) as a forced call is. None where forced calls have no grammar."""
    call = forced_call(fmt, tools, None, tokens, inputs)
    if call is None:
        return None
    rules = call.replace("start:", "call:", 1)
    opening = fmt.forced_opening(None)
    first = tokens.leading(opening)
    if first is not None:
        # The call opens with a token no text spells: text is anything up to that token, with
        # the other added tokens (a reasoning model's think tags, ...).
        others = "".join(f" | <[{i}]>" for i in tokens.ids.values() if i != first)
        return (
            "start: free (opened free)*\n"
            f"free: (TEXT{others})*\n"
            "TEXT: /(?s:.+)/\n"
            f"opened: {tokens.literal(opening)} call\n" + rules
        )
    pattern = "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in opening)
    return (
        "start: (prose call)* TAIL\n"
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
    tokens: AddedTokens,
    grammar: str | None = None,
) -> list[str] | None:
    """Rules for the parameters (`rule` first), for a format that writes each parameter as
    `before KEY between VALUE after` (learned from a probe call): the schema's properties in its
    order, the required ones always; a string's value raw text up to `after`, which the model
    writes as the stop string (in `grammar`, a custom tool's, when given); any other value the
    property's JSON."""

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
    literal = tokens.literal
    required = set(schema.get("required") or [])
    items, values = [], []
    for position, (key, spec) in enumerate((schema.get("properties") or {}).items()):
        value = f"{rule}_{position}"
        if grammar is not None and isinstance(spec, dict) and spec.get("type") == "string":
            values.append(f"{value}: %lark {{\n{grammar.strip()}\n}}")
            item = f"{literal(before + key + between)} {value} {literal(after)}"
        elif isinstance(spec, dict) and spec.get("type") == "string" and "enum" not in spec:
            values.append(f"{value}[stop={json.dumps(after)}]: /(?s:.*)/")
            item = f"{literal(before + key + between)} {value}"
        else:
            values.append(f"{value}: %json {json.dumps({**spec, 'x-guidance': JSON_STYLE})}")
            item = f"{literal(before + key + between)} {value} {literal(after)}"
        items.append(f"({item})" if key in required else f"({item})?")
    return [f"{rule}: {' '.join(items)}", *values] if items else []
