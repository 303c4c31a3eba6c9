"""Speculative decoding with a draft model: a smaller model sharing the served model's tokenizer
guesses each running sequence's next tokens, greedily, in a decode batch of its own.

The draft keeps its own KV cache per sequence and its own prefix cache. It runs only in the
steps that verify guesses, so it lags behind the sequences it guesses for: each sequence's
tokens not yet in its draft cache (at least its next input token) are fed first, all rows in
one pass, then the rows decode `k - 1` more tokens together, each one the previous one's argmax.
After the served model's verify pass, each row keeps the guesses the served model kept; the
rest of its draft columns are taken back as the served model's are (`cache_kinds.rewind`).

A sequence joins the draft batch at the first step that guesses for it: its prompt (and output
so far) is prefilled then, in one go, reusing the draft's prefix cache. The draft is a fraction
of the served model's size, so that pass costs a fraction of the served model's prefill.

A guess is a point mass, whatever model made it: the served model's verify keeps the output
exact (greedy) or its distribution unchanged (sampled), as with prompt lookup.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxgate.engine import batch_check, cache_kinds
from mlxgate.engine.batch import FREE, GREEDY, DecodeBatch
from mlxgate.engine.cache_kinds import CacheLayout, UnsupportedCache
from mlxgate.engine.prefix_cache import PrefixCache
from mlxgate.models.adapter import ModelAdapter

# A row to guess for: (stream id, its prompt and output so far, how many tokens to guess).
Row = tuple[int, np.ndarray, int]


class DraftModel:
    """The draft model, its batch of rows (one per sequence it guesses for) and its prefix cache."""

    def __init__(
        self, model: nn.Module, prefix_cache_bytes: int, prefill_chunk: int, batched: bool
    ) -> None:
        """`batched`: whether the served model decodes several sequences at once (so must the
        draft)."""
        self.adapter = ModelAdapter(model)
        self.layout = CacheLayout.of(self.adapter.make_cache())
        if not self.layout.cuttable:
            raise UnsupportedCache(
                f"a draft model's layers must all be plain attention, to take back rejected "
                f"guesses; this one has {self.layout.describe()}"
            )
        banded = self.adapter.banded_attention
        if batched and (problem := batch_check.check(self.adapter, self.layout, banded).decode):
            raise UnsupportedCache(
                f"the draft model cannot decode several sequences in one batch ({problem})"
            )
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.prefill_chunk = prefill_chunk
        self.reset()

    def reset(self) -> None:
        """Forget every row (after a failed step)."""
        self.batch = DecodeBatch(self.layout, self.adapter.banded_attention)
        self.cached: dict[int, int] = {}  # stream id -> its tokens in the draft cache
        self._ahead = 0  # guesses the last `propose` fed to every row after its tokens

    def propose(self, rows: list[Row]) -> list[np.ndarray]:
        """Greedy guesses for `rows`, which are every sequence the draft is to follow (others
        leave its batch); each row's `k` may be 0 (it only catches up)."""
        self._follow(rows)
        batch = self.batch
        stream_ids = batch.stream_ids.tolist()
        slot_of = {sid: slot for slot, sid in enumerate(stream_ids) if sid != FREE}
        slots = len(stream_ids)
        pending = np.ones(slots, dtype=np.int64)  # a free slot feeds one column of nothing
        width = max(len(tokens) - self.cached[sid] for sid, tokens, _ in rows)
        inputs = np.zeros((slots, width), dtype=np.uint32)
        for sid, tokens, _ in rows:
            rest = tokens[self.cached[sid] :]
            inputs[slot_of[sid], : len(rest)] = rest
            pending[slot_of[sid]] = len(rest)
            self.cached[sid] = len(tokens)
        logits = self.adapter.verify(mx.array(inputs), batch.caches)
        last = logits[mx.arange(slots), mx.array(pending - 1)]
        batch.rewind(pending - 1, width)
        guess = mx.argmax(last, axis=-1).astype(mx.uint32)
        guesses = [guess]
        self._ahead = max(k for _, _, k in rows) - 1
        for _ in range(self._ahead):
            guess = mx.argmax(self.adapter.decode(guess, batch.caches), axis=-1).astype(mx.uint32)
            guesses.append(guess)
        drafted = np.array(mx.stack(guesses, axis=1)).astype(np.int64)
        return [drafted[slot_of[sid], :k] for sid, _, k in rows]

    def settle(self, kept: dict[int, int]) -> None:
        """After the verify pass of the guesses `propose` made: each row keeps the guesses the
        served model kept (`kept`, by stream id; rows not named kept none)."""
        if not self._ahead:
            return
        stream_ids = self.batch.stream_ids.tolist()
        keep = np.zeros(len(stream_ids), dtype=np.int64)
        for slot, sid in enumerate(stream_ids):
            if sid != FREE:
                keep[slot] = min(kept.get(sid, 0), self._ahead)
                self.cached[sid] += int(keep[slot])
        self.batch.rewind(keep - 1, self._ahead)
        self._ahead = 0

    def _follow(self, rows: list[Row]) -> None:
        """Drop the rows of sequences not in `rows`; prefill and add those new to the batch."""
        listed = {sid for sid, _, _ in rows}
        ids = self.batch.stream_ids
        self.batch.drop((ids != FREE) & ~np.isin(ids, list(listed)))
        for sid in [sid for sid in self.cached if sid not in listed]:
            del self.cached[sid]
        for sid, tokens, _ in rows:
            if sid not in self.cached:
                self._join(sid, tokens)

    def _join(self, stream_id: int, tokens: np.ndarray) -> None:
        """Prefill all but the last of `tokens` (that one is the row's first input)."""
        prefix = tokens[:-1].tolist()
        match = self.prefix_cache.lookup([*prefix, 0])  # may reuse all of `prefix`
        if match is not None:
            caches, done = match.caches(), match.length
        else:
            caches, done = self.adapter.make_cache(), 0
        for start in range(done, len(prefix), self.prefill_chunk):
            chunk = mx.array(prefix[start : start + self.prefill_chunk])[None]
            self.adapter.prefill(chunk, caches)
        self.prefix_cache.store(prefix, caches)
        self.batch.add(
            [cache_kinds.batch_of_one(c) for c in caches],
            [len(prefix)],
            [stream_id],
            [GREEDY],
            [int(tokens[-1])],
        )
        self.cached[stream_id] = len(prefix)


def check_vocabularies(served: list[str], draft: list[str]) -> None:
    """A draft model must name tokens as the served model does (its guesses are token ids)."""
    for token_id, (mine, theirs) in enumerate(zip(served, draft, strict=False)):
        if mine != theirs:
            raise ValueError(
                f"the draft model's tokenizer differs from the served model's (token {token_id} "
                f"is {theirs!r} in the draft, {mine!r} in the served model): a draft model must "
                "share the served model's tokenizer"
            )
