"""The running batch: one row per decoding sequence, a shared batched KV cache, batched sampling."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from mlxgate.engine.sampling import Sampler


class DecodeBatch:
    """Rows are added when their prompt is prefilled and dropped when they finish or cancel.

    Per-row state lives in numpy arrays so a step's bookkeeping is a few vector operations,
    whatever the batch size.
    """

    def __init__(self) -> None:
        self.caches: list[BatchKVCache] = []
        self.stream_ids = np.zeros(0, dtype=np.uint64)
        self.remaining = np.zeros(0, dtype=np.int64)  # tokens each row may still produce
        self.samplers: list[Sampler] = []
        self.inputs: mx.array | None = None  # the token each row feeds next

    def __len__(self) -> int:
        return len(self.samplers)

    def add(
        self,
        caches: Sequence[BatchKVCache],
        stream_ids: Sequence[int],
        remaining: Sequence[int],
        samplers: Sequence[Sampler],
        inputs: Sequence[int],
    ) -> None:
        if not self.caches:
            self.caches = list(caches)
        else:
            for mine, theirs in zip(self.caches, caches, strict=True):
                mine.extend(theirs)
        self.stream_ids = np.concatenate([self.stream_ids, np.asarray(stream_ids, dtype=np.uint64)])
        self.remaining = np.concatenate([self.remaining, np.asarray(remaining, dtype=np.int64)])
        self.samplers.extend(samplers)
        joined = mx.array(list(inputs), dtype=mx.uint32)
        self.inputs = joined if self.inputs is None else mx.concatenate([self.inputs, joined])

    def keep(self, rows: np.ndarray) -> None:
        """Keep only `rows` (sorted indices), in that order."""
        if len(rows) == 0:
            self.caches = []
            self.stream_ids = self.stream_ids[:0]
            self.remaining = self.remaining[:0]
            self.samplers = []
            self.inputs = None
            return
        index = mx.array(rows.astype(np.int32))
        for cache in self.caches:
            cache.filter(index)
        self.stream_ids = self.stream_ids[rows]
        self.remaining = self.remaining[rows]
        self.samplers = [self.samplers[i] for i in rows]
        assert self.inputs is not None
        self.inputs = self.inputs[index]

    def sample(self, logits: mx.array) -> mx.array:
        """Next token per row: one argmax for greedy rows, per-row samplers for the others."""
        if all(s.params.greedy for s in self.samplers):
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
        picks = [
            greedy[i : i + 1] if s.params.greedy else s(logits[i : i + 1]).astype(mx.uint32)
            for i, s in enumerate(self.samplers)
        ]
        return mx.concatenate(picks)
