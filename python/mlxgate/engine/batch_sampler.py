"""Sampling a decode batch's next tokens: one row per slot, penalties, grammar masks and
log-probabilities.

Each row samples with its own `Sampler` (engine/sampling.py); greedy rows share one argmax. A
row with penalties has them applied first (engine/penalties.py; at each position of a verify
pass, as if its guesses before it were kept), and counts the tokens it goes on with (`seen`). A
row held to a grammar chooses among the tokens its matcher allows (engine/constraints.py), and
its matcher moves on once the step's tokens are known (`advance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import mlx.core as mx
import numpy as np

from mlxgate.engine.batch import FREE
from mlxgate.engine.constraints import Vocabulary
from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.penalties import penalized
from mlxgate.engine.sampling import Sampler

# A row's log-probabilities as `Router.logprobs` takes them: (stream id, token id, logprob,
# [(alternative id, logprob), ...]).
LogprobEntry = tuple[int, int, float, list[tuple[int, float]]]


class BatchSampler:
    """What the last sampling step of one decode batch left to do: matchers to move on, the
    log-probabilities of its tokens, the sampled rows whose keys move on by what a verify pass
    keeps."""

    def __init__(self) -> None:
        # (slot, matcher) of the rows the last `sample` held to a grammar: `advance` moves them on.
        self._matchers: list[tuple[int, llguidance.LLMatcher]] = []
        # The last `sample`'s log-probabilities, for the rows that asked (see `logprobs`).
        self._logprobs: _Logprobs | None = None
        # (slot, sampler) of the rows the last `sample_positions` sampled ahead.
        self._ahead: list[tuple[int, Sampler]] = []

    def sample(
        self, logits: mx.array, samplers: Sequence[Sampler], vocabulary: Vocabulary | None = None
    ) -> mx.array:
        """Next token per row (`samplers`: per slot): one argmax for greedy rows, per-row samplers
        for the others; rows with penalties have them applied, rows with a grammar choose among
        the tokens it allows."""
        rows = [(i, s.penalties, ()) for i, s in enumerate(samplers) if s.penalties is not None]
        return self._sample(penalized(logits, rows), samplers, vocabulary)

    def _sample(
        self, logits: mx.array, samplers: Sequence[Sampler], vocabulary: Vocabulary | None
    ) -> mx.array:
        self._matchers = [
            (i, s.matcher_in(vocabulary, logits.shape[-1]))
            for i, s in enumerate(samplers)
            if s.grammar is not None
        ]
        if self._matchers:
            assert vocabulary is not None  # (matcher_in has made sure)
            logits = _masked(logits, self._matchers, vocabulary)
        if all(s.params.greedy for s in samplers):
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        else:
            greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
            picks = [
                greedy[i : i + 1] if s.params.greedy else s(logits[i : i + 1]).astype(mx.uint32)
                for i, s in enumerate(samplers)
            ]
            tokens = mx.concatenate(picks)
        asked = [(i, s.params) for i, s in enumerate(samplers) if s.params.logprobs is not None]
        self._logprobs = _Logprobs.of(logits, tokens, asked) if asked else None
        return tokens

    def sample_positions(
        self,
        logits: mx.array,
        guesses: np.ndarray,
        counts: np.ndarray,
        samplers: Sequence[Sampler],
        vocabulary: Vocabulary | None = None,
    ) -> np.ndarray:
        """For a verify pass (`logits`: [slots, positions, vocab]; `guesses`: [slots, positions
        - 1], the tokens it fed after each row's input; `counts`: per slot, how many of them it
        guessed): the token each row's sampler samples at every position [slots, positions].
        Position 0 is sampled as a decode step samples (grammars and log-probabilities included:
        rows with those do not guess); the rest only for rows that guessed. Sampled rows' keys
        move on by `keep`, once the kept guesses are known."""
        logits = _penalized_positions(logits, guesses, counts, samplers)
        first = self._sample(logits[:, 0, :], samplers, vocabulary)
        guessing = np.flatnonzero(counts).tolist()
        self._ahead = [(i, samplers[i]) for i in guessing if not samplers[i].params.greedy]
        later = mx.argmax(logits[:, 1:, :], axis=-1).astype(mx.uint32)
        if self._ahead:
            picks = [
                sampler.ahead(logits[i, 1 : 1 + int(counts[i])]).astype(mx.uint32)
                for i, sampler in self._ahead
            ]
            mx.eval(first, later, picks)
            later_np = np.array(later)
            for (i, _), pick in zip(self._ahead, picks, strict=True):
                later_np[i, : pick.size] = np.array(pick)
        else:
            mx.eval(first, later)
            later_np = np.array(later)
        return np.concatenate([np.array(first)[:, None], later_np], axis=1)

    def keep(self, kept: np.ndarray) -> None:
        """Each slot kept `kept[slot]` of the guesses the last `sample_positions` sampled."""
        for i, sampler in self._ahead:
            sampler.keep(int(kept[i]))
        self._ahead = []

    def seen(self, samplers: Sequence[Sampler], tokens: np.ndarray, kept: np.ndarray) -> None:
        """Each slot went on with `tokens[slot, : kept[slot] + 1]`: what its penalties count."""
        for i, sampler in enumerate(samplers):
            if sampler.penalties is not None:
                sampler.penalties.seen(tokens[i, : int(kept[i]) + 1].tolist())

    def advance(self, tokens: mx.array) -> None:
        """Each slot feeds `tokens[slot]` next: the grammars of the last `sample` consume it."""
        token_ids = np.array(tokens, copy=False)
        for slot, matcher in self._matchers:
            matcher.consume_token(int(token_ids[slot]))

    def logprobs(self, stream_ids: np.ndarray) -> list[LogprobEntry]:
        """The last sampled tokens' log-probabilities, for the rows whose requests asked
        (`stream_ids`: per slot; free slots are left out)."""
        if self._logprobs is None:
            return []
        return self._logprobs.entries(stream_ids)


def _penalized_positions(
    logits: mx.array, guesses: np.ndarray, counts: np.ndarray, samplers: Sequence[Sampler]
) -> mx.array:
    """A verify pass's `logits` with each row's penalties at each position it samples: at
    position j, as if its first j guesses were kept (a kept guess is the token sampled there, so
    the tokens equal a decode step's)."""
    slots, width, vocab = logits.shape
    rows = [
        (i * width + j, sampler.penalties, guesses[i, :j].tolist())
        for i, sampler in enumerate(samplers)
        if sampler.penalties is not None
        for j in range(int(counts[i]) + 1)
    ]
    if not rows:
        return logits
    return penalized(logits.reshape(slots * width, vocab), rows).reshape(slots, width, vocab)


@dataclass(frozen=True)
class _Logprobs:
    """Log-probabilities of one step's sampled tokens and top alternatives, for some rows."""

    rows: list[int]
    alternatives: list[int]  # per row, how many it asked for
    tokens: mx.array  # the step's sampled tokens, every slot
    chosen: mx.array  # [rows]
    top_ids: mx.array  # [rows, max alternatives]
    top: mx.array

    @classmethod
    def of(
        cls, logits: mx.array, tokens: mx.array, asked: list[tuple[int, SamplingParams]]
    ) -> _Logprobs:
        rows = [i for i, _ in asked]
        index = mx.array(rows)
        # After temperature (a greedy row's logits as they are), as OpenAI documents.
        scale = mx.array([1.0 / p.temperature if not p.greedy else 1.0 for _, p in asked])
        scaled = logits[index].astype(mx.float32) * scale[:, None]
        logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens[index][:, None].astype(mx.int32), axis=-1)
        alternatives = [p.logprobs or 0 for _, p in asked]
        k = max(alternatives)
        top_ids = (
            mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
            if k
            else mx.zeros((len(rows), 0), mx.uint32)
        )
        top = mx.take_along_axis(logprobs, top_ids, axis=-1) if k else mx.zeros((len(rows), 0))
        return cls(rows, alternatives, tokens, chosen[:, 0], top_ids, top)

    def entries(self, stream_ids: np.ndarray) -> list[LogprobEntry]:
        tokens, chosen, top_ids, top = (
            np.array(a) for a in (self.tokens, self.chosen, self.top_ids, self.top)
        )
        out = []
        for j, (slot, k) in enumerate(zip(self.rows, self.alternatives, strict=True)):
            if stream_ids[slot] == FREE:
                continue
            order = np.argsort(-top[j], kind="stable")[:k]
            alternatives = [(int(top_ids[j, o]), float(top[j, o])) for o in order]
            out.append((int(stream_ids[slot]), int(tokens[slot]), float(chosen[j]), alternatives))
        return out


def _masked(
    logits: mx.array, matchers: list[tuple[int, llguidance.LLMatcher]], vocabulary: Vocabulary
) -> mx.array:
    """`logits` with the tokens each constrained row's grammar forbids at -inf. One `where`
    over the whole batch: at 32 rows MLX's CPU scatter of just the constrained rows took 5x as
    long (10 ms against 2 ms)."""
    allowed = np.ones(logits.shape, dtype=np.bool_)
    allowed[[slot for slot, _ in matchers]] = vocabulary.allowed([m for _, m in matchers])
    return mx.where(mx.array(allowed), logits, -mx.inf)
