"""Constrained decoding: a grammar per sequence decides which tokens its row may sample next.

The grammar engine is llguidance (Rust; no dependencies; JSON Schema, Lark and regular
expressions; masks computed for many sequences at once on its own threads, without the GIL).
A request carries a `Grammar`; its row's sampler makes a matcher on the row's first step, and
each step asks for the allowed tokens of every constrained row at once, masks those rows'
logits and, once the tokens are sampled, moves their matchers on (engine/batch_sampler.py).
Rows without a grammar pay nothing: with no constrained row nothing is computed, and beside
constrained rows their logits pass through unchanged.

When the grammar is complete the matcher allows only the end-of-turn tokens, so a constrained
reply ends where its grammar does.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger("mlxgate")


class GrammarError(ValueError):
    """A grammar or JSON schema the engine cannot enforce; the message says what in it."""


@dataclass(frozen=True)
class Grammar:
    """What a reply must match, as llguidance grammar text; build with the class methods."""

    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | None) -> Grammar:
        """Any JSON value the schema accepts; `None` is JSON mode: any JSON object."""
        schema = {"type": "object"} if schema is None else schema
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return cls(text)._checked()

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls(llguidance.LLMatcher.grammar_from_lark(grammar))._checked()

    def _checked(self) -> Grammar:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.text)
        if failed:
            raise GrammarError(_readable(messages[0]))
        return self


def _readable(message: str) -> str:
    """llguidance's message on one line (a regex error comes with a drawing of where)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:500]


class Vocabulary:
    """The model's tokens as llguidance sees them: matchers for grammars, masks for rows.

    Built on the first constrained request (a large vocabulary takes about a second), from the
    tokenizer itself, so that the grammar and the model agree on every token's bytes."""

    def __init__(self, tokenizer: Tokenizer, end_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._end_ids = end_ids
        self._llg: llguidance.LLTokenizer | None = None
        self._width = 0
        self._executor = llguidance.LLExecutor(num_threads=min(2, os.cpu_count() or 1))

    def _ready(self, width: int) -> llguidance.LLTokenizer:
        if self._llg is None:
            started = time.perf_counter()
            self._llg = llguidance.LLTokenizer(
                self._tokenizer.to_str(), n_vocab=width, eos_token=self._end_ids
            )
            self._width = width
            log.info("grammar vocabulary ready in %.2fs", time.perf_counter() - started)
        return self._llg

    def matcher(self, grammar: Grammar, width: int) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._ready(width), grammar.text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_readable(matcher.get_error()))
        return matcher

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """Which tokens each matcher allows next: bool [len(matchers), vocabulary width]."""
        words = (self._width + 31) // 32
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bits.ctypes.data, words * 4, len(matchers)
        )
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, : self._width].astype(np.bool_)
