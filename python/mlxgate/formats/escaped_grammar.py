"""A Lark grammar's language written inside a JSON string: the grammar whose sentences are the
original's sentences JSON-escaped (`"` as `\\"`, a newline as `\\n`, ...), so that a custom
tool's input can be held to its grammar where the tool format writes the input as a JSON string
(Hermes, Llama 3, Mistral, ...), not raw.

The grammar is read with the `lark` package (its own BNF form: rules of symbols, terminals as a
literal or a regular expression), each terminal is escaped (a literal as JSON writes it; a
regular expression through Python's own regex parser, character by character), and the result
is written back as llguidance Lark. What cannot be escaped exactly (anchors, backreferences,
lookarounds, regex flags) makes the grammar unsupported: `escaped` returns None, and the input is
held to a JSON string only.
"""

from __future__ import annotations

import json
import logging
import re
import re._constants as sre_constants  # Python's own regex parser, as `re` compiles with it
import re._parser as sre_parser
from typing import Any

import lark
from lark.lexer import PatternStr
from lark.load_grammar import load_grammar

# Characters JSON must escape, and the escapes a model writes for them.
SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
SPECIAL = {chr(c) for c in range(0x20)} | {'"', "\\"}

log = logging.getLogger("mlxgate")


class Unsupported(ValueError):
    """A construct with no exact JSON-escaped counterpart."""


def _char(char: str) -> str:
    """`char` in a regex, literally (inside a class or out)."""
    if char.isalnum() or ord(char) >= 0x80:
        return char
    return f"\\x{ord(char):02x}"


def _class_item(low: int, high: int) -> str:
    first, last = _char(chr(low)), _char(chr(high))
    return first if low == high else f"{first}-{last}"


def _ranges(items: list[tuple[Any, Any]]) -> list[tuple[int, int]]:
    """The code point ranges a character class's items name."""
    out = []
    for op, value in items:
        if op is sre_constants.LITERAL:
            out.append((value, value))
        elif op is sre_constants.RANGE:
            out.append(value)
        elif op is sre_constants.CATEGORY and value is sre_constants.CATEGORY_DIGIT:
            out.append((ord("0"), ord("9")))
        elif op is sre_constants.CATEGORY and value is sre_constants.CATEGORY_SPACE:
            out.extend((ord(c), ord(c)) for c in " \t\n\r\f\v")
        else:
            raise Unsupported(f"character class item {op} {value}")
    return out


class _Writer:
    """Writes the escaped grammar. Every escape is a lexeme of its own (`ESCAPE_..`), and a
    regular expression becomes a rule over single-character lexemes and escapes: llguidance's
    lexer does not backtrack, so an escape may not hide inside a longer lexeme (after `(.+)`, the
    `\\` of `\\n` would be taken as the start of one more character)."""

    def __init__(self) -> None:
        self.terminals: dict[str, str] = {}  # name -> definition

    def escape(self, char: str) -> str:
        name = f"ESCAPE_{ord(char):02X}"
        if name not in self.terminals:
            forms = [SHORT_ESCAPES[char]] if char in SHORT_ESCAPES else []
            forms.append(f"\\u{ord(char):04x}")
            self.terminals[name] = (
                json.dumps(forms[0])
                if len(forms) == 1
                else " | ".join(json.dumps(form) for form in forms)
            )
        return name

    def plain(self, regex_class: str) -> str:
        for name, definition in self.terminals.items():
            if definition == f"/{regex_class}/":
                return name
        name = f"PLAIN_{sum(n.startswith('PLAIN_') for n in self.terminals)}"
        self.terminals[name] = f"/{regex_class}/"
        return name

    def literal(self, text: str) -> str:
        """A string as it is written inside a JSON string."""
        parts, plain = [], ""
        for char in text:
            if char in SPECIAL:
                if plain:
                    parts.append(json.dumps(plain))
                    plain = ""
                parts.append(self.escape(char))
            else:
                plain += char
        if plain:
            parts.append(json.dumps(plain))
        return " ".join(parts) or '""'

    def char_set(self, ranges: list[tuple[int, int]], negated: bool, run: bool = False) -> str:
        """One character of a set (`negated`: of its complement) inside a JSON string; with
        `run`, a run of its ordinary characters is one lexeme (fewer lexemes, cheaper masks)."""
        inside = {c for c in SPECIAL if any(lo <= ord(c) <= hi for lo, hi in ranges)}
        specials = sorted(SPECIAL - inside if negated else inside)
        if negated:
            items = "".join(_class_item(lo, hi) for lo, hi in ranges)
            plain = f"[^{items}\\x00-\\x1f\\x22\\x5c]"
        else:
            pieces = []
            for low, high in ranges:
                start = low
                for code in range(low, min(high, 0x5C) + 1):  # around the special ones
                    if chr(code) in SPECIAL:
                        if start < code:
                            pieces.append(_class_item(start, code - 1))
                        start = code + 1
                if start <= high:
                    pieces.append(_class_item(start, high))
            plain = "[" + "".join(pieces) + "]" if pieces else ""
        options = [self.plain(plain + ("+" if run else ""))] if plain else []
        options += [self.escape(c) for c in specials]
        if not options:
            raise Unsupported("an empty character set")
        return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"

    def regex(self, pattern: Any, tail: bool = True) -> str:
        """Python's parse of a regex as a Lark expression over its sentences' JSON escaping.
        `tail`: nothing follows `pattern` in its terminal, so a repeated character set at its
        end can take a run of ordinary characters as one lexeme (elsewhere a greedy run could
        swallow what the rest of the terminal needs: the lexer does not backtrack)."""
        out = []
        for index, (op, value) in enumerate(pattern):
            last = tail and index == len(pattern) - 1
            if last and (run := self._run(op, value)) is not None:
                out.append(run)
            elif op is sre_constants.LITERAL:
                out.append(self.literal(chr(value)))
            elif op is sre_constants.NOT_LITERAL:
                out.append(self.char_set([(value, value)], negated=True))
            elif op is sre_constants.ANY:
                out.append(self.char_set([(ord("\n"), ord("\n"))], negated=True))
            elif op is sre_constants.IN:
                negated = bool(value) and value[0][0] is sre_constants.NEGATE
                out.append(self.char_set(_ranges(value[1:] if negated else value), negated))
            elif op is sre_constants.BRANCH:
                branches = (self.regex(branch, last) for branch in value[1])
                out.append("(" + " | ".join(branches) + ")")
            elif op is sre_constants.SUBPATTERN:
                _, add_flags, del_flags, inner = value
                if add_flags or del_flags:
                    raise Unsupported("inline regex flags")
                out.append("(" + self.regex(inner, last) + ")")
            elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
                low, high, inner = value
                out.append(_repeat(f"({self.regex(inner, tail=False)})", low, high))
            else:
                raise Unsupported(f"regex construct {op}")
        return " ".join(out) or '""'

    def _run(self, op: Any, value: Any) -> str | None:
        """A greedy `set*` / `set+` as runs of ordinary characters and escapes; None for other
        constructs."""
        if op is not sre_constants.MAX_REPEAT:
            return None
        low, high, inner = value
        if high is not sre_constants.MAXREPEAT or low > 1 or len(inner) != 1:
            return None
        kind, item = inner[0]
        if kind is sre_constants.ANY:
            one = self.char_set([(ord("\n"), ord("\n"))], negated=True, run=True)
        elif kind is sre_constants.NOT_LITERAL:
            one = self.char_set([(item, item)], negated=True, run=True)
        elif kind is sre_constants.IN:
            negated = bool(item) and item[0][0] is sre_constants.NEGATE
            one = self.char_set(_ranges(item[1:] if negated else item), negated, run=True)
        else:
            return None
        return f"({one})" + ("+" if low else "*")


def _repeat(item: str, low: int, high: Any) -> str:
    unbounded = high is sre_constants.MAXREPEAT
    if low > 32 or (not unbounded and high > 32):
        raise Unsupported("a repetition count over 32")
    required = [item] * max(low - (1 if unbounded and low else 0), 0)
    if unbounded:
        required.append(f"{item}+" if low else f"{item}*")
    else:
        required += [f"{item}?"] * (high - low)
    return " ".join(required) or '""'


def escaped(grammar: str) -> str | None:
    """`grammar` (Lark) rewritten to match its sentences as written inside a JSON string, in
    llguidance's Lark; None where that cannot be exact."""
    writer = _Writer()
    try:
        loaded, _ = load_grammar(grammar, "<custom tool>", [], False)
        terminals, rules, ignored = loaded.compile(["start"], set())
        if ignored:
            raise Unsupported("%ignore: llguidance's Lark has no skipped terminals")
        symbols: dict[str, str] = {}  # a terminal of the grammar -> what stands for it
        bodies: dict[str, str] = {}  # rules the regular expressions became
        for terminal in terminals:
            pattern = terminal.pattern
            if pattern.flags:
                raise Unsupported("regex flags")
            if isinstance(pattern, PatternStr):
                symbols[terminal.name] = writer.literal(pattern.value)
            else:
                name = "re_" + terminal.name.lower().lstrip("_")
                bodies[name] = writer.regex(sre_parser.parse(pattern.value))
                symbols[terminal.name] = name
        alternatives: dict[str, list[str]] = {}
        for rule in rules:
            expansion = " ".join(
                symbols.get(symbol.name) or _name(symbol.name) for symbol in rule.expansion
            )
            alternatives.setdefault(_name(rule.origin.name), []).append(expansion or '""')
    except (lark.exceptions.LarkError, Unsupported, re.error, ValueError, KeyError) as exc:
        # The grammar compiled in llguidance (the request checked it): held as a JSON string.
        log.info("a custom tool's grammar is held as a JSON string only: %s", exc)
        return None
    lines = [f"{name}: {' | '.join(options)}" for name, options in alternatives.items()]
    lines += [f"{name}: {body}" for name, body in bodies.items()]
    lines += [f"{name}: {definition}" for name, definition in writer.terminals.items()]
    return "\n".join(lines) + "\n"


def _name(name: str) -> str:
    """Lark's generated rule names (`__start_plus_0`) prefixed as llguidance takes them."""
    return "g" + name if name.startswith("_") else name
