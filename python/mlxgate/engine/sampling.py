"""Token sampling from next-token logits: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import llguidance
import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlxgate.engine.constraints import Grammar, Vocabulary
from mlxgate.engine.contract import SamplingParams


class Sampler:
    """Samples one sequence's next token; holds its own PRNG key so seeds are per request, and
    the matcher of its grammar, if it has one (made on its first step: engine/constraints.py)."""

    def __init__(self, params: SamplingParams, grammar: Grammar | None = None) -> None:
        self.params = params
        self.grammar = grammar
        self.matcher: llguidance.LLMatcher | None = None
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    def matcher_in(self, vocabulary: Vocabulary | None, width: int) -> llguidance.LLMatcher:
        """The matcher of this sequence's grammar (which it must have), made on first use."""
        if self.matcher is None:
            assert self.grammar is not None and vocabulary is not None, "no grammar to match"
            self.matcher = vocabulary.matcher(self.grammar, width)
        return self.matcher

    def __call__(self, logits: mx.array) -> mx.array:
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        key = None
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=key)
