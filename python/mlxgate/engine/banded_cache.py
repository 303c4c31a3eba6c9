"""One layer's KV cache for a decode batch whose rows are kept in bands of similar length.

A batched KV cache pads every row to the longest: one 1,500-token row among rows of 200 tokens
makes all of them attend over 1,500 columns, every step. Here each band (a consecutive range of
the batch's rows) is a `BatchKVCache` of its own width. The model runs all rows through its
projections and MLP together; `update_and_fetch` and `make_mask` answer one entry per band, and
the attention (models/cpu/attention.py, which knows it as a `Banded` cache) attends band by band.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxgate.models.cpu.attention import Banded


class BandedCache(Banded):
    def __init__(
        self, bands: Sequence[BatchKVCache], ranges: list[tuple[int, int]], offset: mx.array
    ) -> None:
        self.bands = list(bands)
        self.ranges = ranges  # each band's rows in the batch, [start, stop)
        self.offset = offset  # read by the model's rotary embedding before `update_and_fetch`

    @classmethod
    def per_layer(cls, bands: Sequence[Sequence[BatchKVCache]]) -> list[BandedCache]:
        """One BandedCache per layer for `bands[band][layer]`. Every layer has the same rows and
        offsets at the start of a step, so they are worked out once, from the first layer."""
        first = [layers[0] for layers in bands]
        rows = [cache.offset.shape[0] for cache in first]
        ranges = list(itertools.pairwise([0, *itertools.accumulate(rows)]))
        offset = mx.concatenate([cache.offset for cache in first])
        return [cls(layer, ranges, offset) for layer in zip(*bands, strict=True)]

    def split(self, rows: mx.array) -> list[mx.array]:
        """`rows` (batch first) cut into the bands' parts."""
        return [rows[start:stop] for start, stop in self.ranges]

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[list[mx.array], list[mx.array]]:
        fetched = [
            band.update_and_fetch(k, v)
            for band, k, v in zip(self.bands, self.split(keys), self.split(values), strict=True)
        ]
        return [k for k, _ in fetched], [v for _, v in fetched]

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> list[Any]:
        return [band.make_mask(n, return_array=return_array, **kwargs) for band in self.bands]
