"""Token sampling from next-token logits: greedy, temperature, top-k, top-p, per-request seed (the
penalties before them: engine/penalties.py)."""

from __future__ import annotations

import llguidance
import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlxgate.engine.constraints import Grammar, Vocabulary
from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.penalties import Penalties


class Sampler:
    """Samples one sequence's next token; holds its own PRNG key so seeds are per request, and
    the matcher of its grammar, if it has one (made on its first step: engine/constraints.py),
    and the recent tokens its penalties count (`prompt_ids`: the prompt they start from)."""

    def __init__(
        self,
        params: SamplingParams,
        grammar: Grammar | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.penalties = Penalties.of(params, prompt_ids or [])
        self.matcher: llguidance.LLMatcher | None = None
        self._key = mx.random.key(params.seed) if params.seed is not None else None
        self._ahead: list[mx.array] = []  # the key after each position of the last `ahead`

    def matcher_in(self, vocabulary: Vocabulary | None, width: int) -> llguidance.LLMatcher:
        """The matcher of this sequence's grammar (which it must have), made on first use."""
        if self.matcher is None:
            assert self.grammar is not None and vocabulary is not None, "no grammar to match"
            self.matcher = vocabulary.matcher(self.grammar, width)
        return self.matcher

    def __call__(self, logits: mx.array) -> mx.array:
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        key = None
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
        return self._sample(logits, key)

    def ahead(self, logits: mx.array) -> mx.array:
        """One token for each row of `logits` [positions, vocab], the successive positions after
        the one `__call__` sampled, each with the key a call of its own would use. The key moves
        on only by `keep`: positions whose tokens are not kept leave it as it was."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        key, picks, self._ahead = self._key, [], []
        for i in range(len(logits)):
            sub = None
            if key is not None:
                key, sub = mx.random.split(key)
                self._ahead.append(key)
            picks.append(self._sample(logits[i : i + 1], sub))
        return mx.concatenate(picks)

    def keep(self, n: int) -> None:
        """The first `n` tokens of the last `ahead` were kept."""
        if n and self._ahead:
            self._key = self._ahead[n - 1]
        self._ahead = []

    def _sample(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        p = self.params
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=key)
