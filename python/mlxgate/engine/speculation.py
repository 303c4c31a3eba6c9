"""Speculative decoding: what each running sequence guesses, and which guesses it keeps.

Each running sequence guesses its next tokens, and one forward pass checks the guesses of every
row. The guesses come from the sequence's own prompt and output (prompt lookup, here), or from
a smaller draft model (`--draft-model`, engine/drafter.py).

On CPU a decode step is bound by reading the weights, so a pass over a few positions per row
costs little more than over one. Agents quote files, tool output and code that already stand in
the prompt: the continuation of the latest earlier occurrence of a sequence's last few tokens is
often what it writes next.

Exact by construction. The verify pass gives logits at every guessed position; the row's own
sampler samples a token at each, and a guess is kept while it equals that sample. A greedy row
emits what it would have one step at a time. A sampled row's guess is a point mass, for which
"keep while equal to the sample" is the rejection-sampling rule (the guess d is kept with
probability p(d), else the sample is drawn from p without d): the distribution is unchanged,
and since each emitted token is sampled with the key its own step would have used, a seed gives
the same tokens with speculation on or off.

Attention layers and sliding windows take back the positions of rejected guesses (their keys
and values are cut: `cache_kinds.rewind`), and so do gated delta layers, whose states are
restored from the pass's record (models/recurrent_guesses.py). Other recurrent states are
updated in place by the verify pass, and keeping one snapshot per guessed position would cost
more than the guesses save on this CPU; speculation is off for models with such layers
(`CacheLayout.rewindable`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.nn as nn
import numpy as np

from mlxgate.engine.batch import FREE
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.contract import GenerationRequest
from mlxgate.engine.drafter import DraftModel
from mlxgate.engine.settings import EngineSettings

log = logging.getLogger("mlxgate.engine")

# Draft lengths: a row starts at START, grows by GROW after a fully kept guess, falls back to
# what it kept (plus one) after a miss.
START = 4
GROW = 2
# The suffix looked up: at least MIN_MATCH tokens (one token alone matches too much by chance),
# at most MAX_MATCH.
MIN_MATCH = 2
MAX_MATCH = 4
# A row whose guesses miss this many verify passes running stops guessing for PAUSE steps, twice
# as long after each further pause (a chat reply seldom repeats its prompt).
MISSES = 3
PAUSE = 8
# What a row's guesses kept and missed count for, a verify pass (or a step it did not guess in)
# later: the chance it keeps a guess follows its latest passes, and one that guessed badly is
# tried again a few dozen steps on.
EVIDENCE_KEPT = 0.9
# How many passes' worth a position's chance of a kept guess starts from, before its own.
PRIOR_PASSES = 2.0
# Guessed positions whose chances a row keeps (guesses beyond take the last one's).
MAX_POSITIONS = 32


# Guesses up to `k` tokens to follow `tokens` (a sequence's prompt and output so far).
Propose = Callable[[np.ndarray, int], np.ndarray]
# How many guesses a row of a verify pass may feed, given each guessing row's guesses kept on
# average for 0, 1, ... up to the guesses it wants, the streams running and the pass's slots.
Worth = Callable[[list[list[float]], int, int], int]


@dataclass
class Lookup:
    """One sequence's guessing: the tokens it has (prompt and output) and how well it guesses."""

    tokens: np.ndarray  # the prompt and output so far, in `[:length]`
    length: int
    draft_len: int = START
    misses: int = 0  # verify passes in a row that kept none of this row's guesses
    pause: int = PAUSE
    paused_until: int = 0  # the step before which this row does not guess
    drafted: int = 0
    accepted: int = 0
    # Per guessed position (the first at 0): the passes that checked it (every guess before it
    # kept), and those that kept it; fading (EVIDENCE_KEPT a step).
    checked: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS))
    hit: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS))

    @classmethod
    def of(cls, prompt_ids: list[int], max_draft: int) -> Lookup:
        tokens = np.zeros(max(64, 2 * len(prompt_ids)), dtype=np.int64)
        tokens[: len(prompt_ids)] = prompt_ids
        return cls(tokens, len(prompt_ids), min(START, max_draft))

    def extend(self, new: np.ndarray) -> None:
        end = self.length + len(new)
        if end > len(self.tokens):
            grown = np.zeros(2 * end, dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : end] = new
        self.length = end

    @property
    def history(self) -> np.ndarray:
        return self.tokens[: self.length]

    def expected_kept(self, most: int) -> list[float]:
        """The guesses this row keeps on average if it guesses 0, 1, ... `most` tokens, from its
        own passes: at each position the chance it keeps that guess where it kept the ones before
        it (a position it never reached takes the chance of the one before; the first, an even
        one). A row that copies keeps long runs of guesses or none, which one chance a guess for
        every position (a geometric run) underrates: an edit's verify passes kept 2 a pass where
        that priced 8 guesses as 1.5."""
        kept, reach, chance = [0.0], 1.0, 0.5
        for i in range(min(most, MAX_POSITIONS)):
            chance = (self.hit[i] + PRIOR_PASSES * chance) / (self.checked[i] + PRIOR_PASSES)
            reach *= chance
            kept.append(kept[-1] + reach)
        return kept

    def fade(self) -> None:
        """A step passed: what this row's earlier passes showed counts for less."""
        self.checked *= EVIDENCE_KEPT
        self.hit *= EVIDENCE_KEPT

    def wanted(self, step: int, room: int) -> int:
        """How many tokens to guess this step (none while paused); at most `room`."""
        return 0 if step < self.paused_until else max(0, min(self.draft_len, room))

    def verified(self, step: int, drafted: int, kept: int, max_draft: int) -> None:
        """`kept` of the `drafted` guesses were right."""
        self.drafted += drafted
        self.accepted += kept
        reached = min(drafted, kept + 1, MAX_POSITIONS)
        self.checked[:reached] += 1
        self.hit[: min(kept, MAX_POSITIONS)] += 1
        if kept == drafted:
            self.draft_len = min(max_draft, self.draft_len + GROW)
            self.misses = 0
            self.pause = PAUSE
            return
        self.draft_len = max(1, kept + 1)
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= MISSES:
            self.paused_until = step + self.pause
            self.pause *= 2
            self.misses = 0


_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PromptLookup:
    """Guesses what followed the latest earlier occurrence of the sequence's last tokens."""

    min_match: int = MIN_MATCH
    max_match: int = MAX_MATCH

    def __call__(self, tokens: np.ndarray, k: int) -> np.ndarray:
        return continuation(tokens, k, self.min_match, self.max_match)


def continuation(tokens: np.ndarray, k: int, min_match: int, max_match: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (between `min_match` and `max_match` tokens long) that occurs earlier."""
    n = len(tokens)
    if n <= min_match:
        return _NONE
    # Where the last token occurred before (each a candidate end of a match), then how far back
    # each candidate keeps matching.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if ends.size == 0:
        return _NONE
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=np.bool_)
    for back in range(1, max_match):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] &= tokens[starts[alive]] == tokens[n - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_match:
        return _NONE
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest
    return tokens[end + 1 : min(end + 1 + k, n)]


@dataclass
class Drafts:
    """One step's guesses: per slot of the decode batch, how many (0 for most rows) and what."""

    counts: np.ndarray  # [slots]
    tokens: np.ndarray  # [slots, width - 1], zero past each row's count
    made_s: float = 0.0  # the guessing's seconds (a draft model's steps), on the rank that guessed

    @property
    def slots(self) -> int:
        return len(self.counts)

    @property
    def width(self) -> int:
        """Positions each row feeds the verify pass: its input token and the most guesses."""
        return int(self.tokens.shape[1]) + 1

    def kept(self, sampled: np.ndarray) -> np.ndarray:
        """The acceptance rule. Per slot: how many guesses equal the tokens sampled at their
        positions, in a row from the first (`sampled`: [slots, width], position 0 after the input
        token)."""
        k = self.tokens.shape[1]
        agree = (self.tokens == sampled[:, :k]) & (np.arange(k)[None, :] < self.counts[:, None])
        return np.cumprod(agree, axis=1).sum(axis=1)  # type: ignore[no-any-return]


@dataclass
class Speculation:
    """The guessing state of every running sequence that takes part, by stream id."""

    max_draft: int
    context: int  # tokens a sequence's cache holds at most: guesses stop there
    propose: Propose = field(default_factory=PromptLookup)
    draft_model: DraftModel | None = None  # guesses in place of `propose`, for all rows at once
    lookups: dict[int, Lookup] = field(default_factory=dict)
    steps: int = 0

    @property
    def drafter(self) -> str:
        """What guesses, as `/metrics` and the request log name it."""
        return "prompt-lookup" if self.draft_model is None else "draft-model"

    @classmethod
    def configured(
        cls,
        settings: EngineSettings,
        layout: CacheLayout,
        context: int,
        draft_model: nn.Module | None,
    ) -> Speculation | None:
        """Speculation as `settings` and the served model's `layout` allow it (None where it is
        off), guessing with `draft_model` if given, else by prompt lookup."""
        s = settings
        if not s.max_draft_tokens or s.speculation_max_rows < 1:
            return None
        if not layout.rewindable:
            log.info(
                "speculative decoding is off: this model's layers (%s) cannot take back the "
                "positions of rejected guesses",
                layout.describe(),
            )
            return None
        speculation = cls(s.max_draft_tokens, context)
        if draft_model is not None:
            speculation.draft_model = DraftModel(
                draft_model,
                s.prefix_cache_mb << 20,
                s.max_prefill_chunk,
                batched=s.max_running > 1 and s.speculation_max_rows > 1,
            )
            log.info(
                "speculative decoding: a draft model (%s) guesses up to %d tokens ahead",
                speculation.draft_model.layout.describe(),
                s.max_draft_tokens,
            )
        return speculation

    def start(self, stream_id: int, request: GenerationRequest) -> None:
        """Let a sequence joining the batch guess, unless its request opted out or is held to
        a grammar or asks for log-probabilities (guessed positions are sampled without them)."""
        if request.speculate and request.grammar is None and request.sampling.logprobs is None:
            self.lookups[stream_id] = Lookup.of(request.prompt_ids, self.max_draft)

    def forget(self, running: int, running_ids: Callable[[], list[int]]) -> None:
        """Drop the state of sequences no longer running (`running` of them; `running_ids`
        says which, asked only when some state is left over)."""
        if len(self.lookups) <= running:
            return
        ids = set(running_ids())
        for stream_id in [sid for sid in self.lookups if sid not in ids]:
            lookup = self.lookups.pop(stream_id)
            log.debug(
                "stream %d: %d of %d guessed tokens kept",
                stream_id,
                lookup.accepted,
                lookup.drafted,
            )

    def drafts(self, stream_ids: np.ndarray, worth: Worth | None = None) -> Drafts | None:
        """This step's guesses for the slots `stream_ids`, as many a row as `worth` says pay
        (engine/scheduler.py's `Scheduler.guesses`); None when no row guesses (a plain decode
        step)."""
        started = time.perf_counter()
        self.steps += 1
        rows = []  # (slot, stream id, lookup, tokens wanted)
        for slot, stream_id in enumerate(stream_ids.tolist()):
            lookup = self.lookups.get(stream_id)
            if lookup is not None:
                lookup.fade()
                # The cache holds all but the last token; the pass adds it and the guesses.
                k = lookup.wanted(self.steps, self.context - lookup.length)
                rows.append((slot, stream_id, lookup, k))
        if worth is not None and any(k for *_, k in rows):
            running = int(np.count_nonzero(stream_ids != FREE))
            kept = [lookup.expected_kept(k) for _, _, lookup, k in rows if k]
            most = worth(kept, running, len(stream_ids))
            rows = [(slot, sid, lookup, min(k, most)) for slot, sid, lookup, k in rows]
        if not any(k for *_, k in rows):
            return None
        if self.draft_model is None:
            guesses = [
                self.propose(lookup.history, k)[:k] if k else _NONE for *_, lookup, k in rows
            ]
        else:
            # A draft row needs a token to prefill besides its first input.
            rows = [row for row in rows if row[2].length >= 2]
            if not any(k for *_, k in rows):
                return None
            guesses = self.draft_model.propose([(sid, lu.history, k) for _, sid, lu, k in rows])
        width = max(guess.size for guess in guesses)
        counts = np.zeros(len(stream_ids), dtype=np.int64)
        tokens = np.zeros((len(stream_ids), width), dtype=np.int64)
        for (slot, *_), guess in zip(rows, guesses, strict=True):
            counts[slot] = guess.size
            tokens[slot, : guess.size] = guess
        return Drafts(counts, tokens, time.perf_counter() - started) if width else None

    def emitted(
        self, stream_ids: np.ndarray, drafts: Drafts | None, kept: np.ndarray, tokens: np.ndarray
    ) -> tuple[int, int]:
        """Record what each slot emitted (`tokens[slot, :kept[slot] + 1]`); returns the step's
        (drafted, accepted) guesses."""
        drafted = accepted = 0
        for slot, stream_id in enumerate(stream_ids.tolist()):
            lookup = self.lookups.get(stream_id)
            if lookup is None:
                continue
            n = int(kept[slot])
            lookup.extend(tokens[slot, : n + 1])
            if drafts is not None and (count := int(drafts.counts[slot])):
                lookup.verified(self.steps, count, n, self.max_draft)
                drafted += count
                accepted += n
        if self.draft_model is not None and drafts is not None:
            self.draft_model.settle(
                {sid: int(n) for sid, n in zip(stream_ids.tolist(), kept.tolist(), strict=True)}
            )
        return drafted, accepted

    def reset(self) -> None:
        """Forget every sequence (after a failed step)."""
        self.lookups.clear()
        if self.draft_model is not None:
            self.draft_model.reset()
