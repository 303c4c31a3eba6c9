"""Attention keys/values kept quantized (`--kv-bits`), for a batch of sequences.

mlx-lm's `QuantizedKVCache` keeps one sequence's keys and values as `mx.quantize` triples
(packed integers, scales, biases); its attention (`quantized_scaled_dot_product_attention`,
chosen by mlx-lm's `scaled_dot_product_attention` for a cache with `bits`) multiplies by them
without dequantizing the whole cache. mlx-lm has no batched form: `BatchQuantizedKVCache` is
`BatchKVCache` with each of keys and values a triple, rows left-padded, an offset per row.

Each token's keys are quantized on their own (groups run along the head dimension), so a row's
quantized keys are the same whether it is computed alone or in a batch, and a prefix cut from a
longer run is what the shorter run would have stored. Every token attends to the quantized keys
of its own pass too, so a prompt prefilled in one pass or in chunks, and a token decoded or
verified after guesses, see the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, dynamic_roll

# (packed, scales, biases) as mx.quantize returns them, each [batch, heads, columns, ...].
Triple = tuple[mx.array, mx.array, mx.array]


class BatchQuantizedKVCache:
    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            room = (self.step + n - 1) // self.step * self.step
            grown: list[Any] = []
            for mine, new in ((self.keys, keys), (self.values, values)):
                batch, heads, _, dim = new.shape
                more = _zeros(batch, heads, room, dim, new.dtype, self.group_size, self.bits)
                grown.append(
                    more
                    if mine is None
                    else _each(
                        lambda a, b: mx.concatenate([a[..., :prev, :], b], axis=2), mine, more
                    )
                )
            self.keys, self.values = grown
        self.offset = self.offset + n
        self._idx += n
        for mine, new in ((self.keys, keys), (self.values, values)):
            quantized = mx.quantize(new, group_size=self.group_size, bits=self.bits)
            for part, written in zip(mine, quantized, strict=True):
                part[..., prev : self._idx, :] = written
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        end = self._idx
        keys = _each(lambda a: a[..., :end, :], self.keys)
        values = _each(lambda a: a[..., :end, :], self.values)
        return keys, values

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            padding = mx.array(list(left_padding))
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        """Move a prefill's right padding to the left, where decoding expects it."""
        if self._right_padding is None:
            return
        assert self.keys is not None and self.values is not None
        shift = self._right_padding[:, None]
        self.keys, self.values = (
            _each(lambda a: dynamic_roll(a, shift, axis=2), kv) for kv in (self.keys, self.values)
        )
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Triple | None, Triple | None, mx.array, mx.array, int]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Triple | None, Triple | None, mx.array, mx.array, int]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(n, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: mx.array) -> None:
        """Keep just the rows `batch_indices`, and drop the columns none of them uses."""
        if self.keys is not None and self.values is not None:
            self.keys, self.values = (
                _each(lambda a: a[batch_indices], kv) for kv in (self.keys, self.values)
            )
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        unused = int(self.left_padding.min()) if self.left_padding.size else 0
        if unused > 0:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = (
                    _each(lambda a: a[..., unused:, :], kv) for kv in (self.keys, self.values)
                )
            self._idx -= unused
            self.left_padding = self.left_padding - unused

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a single-sequence cache of its own (a copy, padding left out)."""
        assert self.keys is not None and self.values is not None
        padding = int(self.left_padding[idx])
        out: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        out.keys, out.values = (
            _each(lambda a: mx.contiguous(a[idx : idx + 1, :, padding : self._idx]), kv)
            for kv in (self.keys, self.values)
        )
        out.offset = self._idx - padding
        return out

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """One batch over single-sequence caches, each row right-aligned to the longest."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        columns = max(lengths)
        out = cls([columns - n for n in lengths], first.group_size, first.bits)
        full = [c for c in caches if c.keys is not None and c.offset]
        if not full:
            return out
        keys: Any
        values: Any
        keys, values = (
            tuple(mx.zeros((len(caches), a.shape[1], columns, a.shape[3]), a.dtype) for a in kv)
            for kv in (full[0].keys, full[0].values)
        )
        for row, cache in enumerate(caches):
            n = cache.offset
            if not n:
                continue
            for mine, theirs in ((keys, cache.keys), (values, cache.values)):
                for part, joining in zip(mine, theirs, strict=True):
                    part[row : row + 1, :, columns - n : columns] = joining[..., :n, :]
        out.keys, out.values = keys, values
        out.offset = out.offset + columns
        out._idx = columns
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for kv in (self.keys, self.values) if kv is not None for a in kv)


def _zeros(
    batch: int, heads: int, columns: int, dim: int, dtype: mx.Dtype, group_size: int, bits: int
) -> Triple:
    """An empty triple for `columns` tokens of `dim` features quantized as `mx.quantize` does."""
    shape = (batch, heads, columns)
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


def _each(f: Any, *triples: Triple) -> Triple:
    """`f` applied part by part (packed, scales, biases) across `triples`."""
    return tuple(f(*parts) for parts in zip(*triples, strict=True))  # type: ignore[return-value]
