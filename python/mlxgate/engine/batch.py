"""The running batch: one row per decoding sequence, batched KV caches, batched sampling.

Rows live in bands of similar length, each band one `BatchKVCache` per layer whose rows are
left-padded to the band's width. A 1,500-token row joining rows of 200 tokens starts a band of
its own: in one shared cache it would pad every row to 1,500 columns (a ~0.3 s copy to join,
then attention over the padding at every step). All bands go through the model in one call;
only attention sees them apart (models/banded_cache.py).

Copying a band's whole KV cache costs ~0.15 s at 32 rows, so rows are slots: a sequence that
ends leaves its slot (still computed, its tokens ignored) until a joining sequence is written
into it, and a band is only compacted once more of its slots are free than in use.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.sampling import Sampler
from mlxgate.models.banded_cache import BandedCache

FREE = 0  # the stream id of a free slot (stream ids start at 1)
# Columns no live row uses (all pad them) before the cache is shifted to drop them: at 32 rows
# each column costs ~0.35 ms of attention per step, a shift one copy of the cache (~0.13 s).
TRIM_COLUMNS = 32
# A joining row starts a new band when the closest band would need more padding than this many
# row-columns to take it: each costs a little attention at every step, a band ~5 ms of extra ops.
BAND_PADDING = 512
MAX_BANDS = 4

_GREEDY = Sampler(SamplingParams())


class DecodeBatch:
    """The bands, seen as one batch: rows (slots) in band order."""

    def __init__(self, banded: bool = True) -> None:
        self.max_bands = MAX_BANDS if banded else 1
        self.bands: list[_Band] = []

    def __len__(self) -> int:
        """Live rows (sequences decoding)."""
        return sum(len(band) for band in self.bands)

    @property
    def stream_ids(self) -> np.ndarray:
        """Per slot; FREE for a free slot."""
        if not self.bands:
            return np.zeros(0, dtype=np.uint64)
        return np.concatenate([band.stream_ids for band in self.bands])

    @property
    def running_ids(self) -> list[int]:
        stream_ids = self.stream_ids
        return stream_ids[stream_ids != FREE].tolist()  # type: ignore[no-any-return]

    @property
    def inputs(self) -> mx.array:
        """The token each slot feeds next."""
        if len(self.bands) == 1:
            return self.bands[0].inputs
        return mx.concatenate([band.inputs for band in self.bands])

    @property
    def caches(self) -> list[Any]:
        """Per layer: the one band's BatchKVCache, or a BandedCache over all bands."""
        if len(self.bands) == 1:
            return self.bands[0].caches
        return BandedCache.per_layer([band.caches for band in self.bands])

    def add(
        self,
        caches: Sequence[BatchKVCache],
        stream_ids: Sequence[int],
        samplers: Sequence[Sampler],
        inputs: Sequence[int],
    ) -> None:
        """Join rows whose keys/values `caches` hold (per layer, rows left-padded to its end)."""
        lengths = np.array(caches[0].offset).tolist()
        bands = list(self.bands)
        widths = [band.columns for band in bands]
        slots = [len(band.stream_ids) for band in bands]
        rows: list[list[int]] = [[] for _ in bands]
        # Longest first, so that a new band is as wide as its first row.
        for row in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
            length = lengths[row]
            padding = [
                width - length if length <= width else (length - width) * n
                for width, n in zip(widths, slots, strict=True)
            ]
            best = int(np.argmin(padding)) if padding else -1
            if best < 0 or (padding[best] > BAND_PADDING and len(bands) < self.max_bands):
                bands.append(_Band())
                widths.append(length)
                slots.append(1)
                rows.append([row])
                continue
            rows[best].append(row)
            widths[best] = max(widths[best], length)
            slots[best] += 1
        for band, band_rows in zip(bands, rows, strict=True):
            if band_rows:
                band.add(caches, lengths, sorted(band_rows), stream_ids, samplers, inputs)
        self.bands = bands
        # The copies are paid now, by the step that admits, not by the next decode step.
        mx.eval([(c.keys, c.values) for band in bands for c in band.caches])

    def drop(self, ended: np.ndarray) -> None:
        """Free the slots of rows that ended (a boolean mask over slots)."""
        if not ended.any():
            return
        start = 0
        for band in self.bands:
            stop = start + len(band.stream_ids)
            band.drop(ended[start:stop])
            start = stop
        self.bands = [band for band in self.bands if len(band)]

    def advance(self, tokens: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Feed each slot its sampled token next; return the live rows' stream ids and tokens."""
        token_ids = np.array(tokens, copy=False)
        if len(self.bands) == 1:
            band = self.bands[0]
            band.inputs = tokens
            return band.stream_ids[band.live], token_ids[band.live]
        stream_ids = self.stream_ids
        start = 0
        for band in self.bands:
            stop = start + len(band.stream_ids)
            band.inputs = tokens[start:stop]
            start = stop
        live = stream_ids != FREE
        return stream_ids[live], token_ids[live]

    def sample(self, logits: mx.array) -> mx.array:
        """Next token per row: one argmax for greedy rows, per-row samplers for the others."""
        samplers = list(itertools.chain.from_iterable(band.samplers for band in self.bands))
        if all(s.params.greedy for s in samplers):
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
        picks = [
            greedy[i : i + 1] if s.params.greedy else s(logits[i : i + 1]).astype(mx.uint32)
            for i, s in enumerate(samplers)
        ]
        return mx.concatenate(picks)


class _Band:
    """Rows sharing one BatchKVCache per layer. Per-slot state lives in numpy arrays, so a
    step's bookkeeping is a few vector operations whatever the number of rows.
    """

    def __init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        self.caches: list[BatchKVCache] = []
        self.stream_ids = np.zeros(0, dtype=np.uint64)  # per slot; FREE when the slot is free
        self.samplers: list[Sampler] = []
        self.inputs = mx.array([], dtype=mx.uint32)  # the token each slot feeds next

    def __len__(self) -> int:
        return int(np.count_nonzero(self.stream_ids))

    @property
    def live(self) -> np.ndarray:
        return self.stream_ids != FREE

    @property
    def columns(self) -> int:
        return self.caches[0].size() if self.caches else 0

    def add(
        self,
        caches: Sequence[BatchKVCache],
        lengths: list[int],
        rows: list[int],
        stream_ids: Sequence[int],
        samplers: Sequence[Sampler],
        inputs: Sequence[int],
    ) -> None:
        """Join `rows` of the joining `caches` (per layer, rows left-padded to its end; `lengths`
        their tokens): into free slots where they fit, else as new slots."""
        placed: list[tuple[int, int]] = []  # (slot, joining row)
        appended: list[int] = rows
        if not self.caches:
            self.caches = [_rows_of(cache, rows) for cache in caches]
        else:
            columns = self.columns
            free = np.flatnonzero(~self.live).tolist()
            appended = []
            for row in rows:
                if free and lengths[row] <= columns:
                    placed.append((free.pop(0), row))
                else:
                    appended.append(row)
            if placed:
                self._write_slots(caches, placed, lengths, columns)
            if appended:
                self._append(caches, appended)
        tokens = np.array(self.inputs, copy=True)
        for slot, row in placed:
            tokens[slot] = inputs[row]
            self.stream_ids[slot] = stream_ids[row]
            self.samplers[slot] = samplers[row]
        tokens = np.concatenate([tokens, np.asarray([inputs[r] for r in appended], np.uint32)])
        self.inputs = mx.array(tokens)
        self.stream_ids = np.concatenate(
            [self.stream_ids, np.asarray([stream_ids[r] for r in appended], np.uint64)]
        )
        self.samplers.extend(samplers[r] for r in appended)

    def _write_slots(
        self,
        caches: Sequence[BatchKVCache],
        placed: list[tuple[int, int]],
        lengths: list[int],
        columns: int,
    ) -> None:
        """Copy joining rows into free slots, right-aligned with the batch (in place)."""
        padding = np.array(self.caches[0].left_padding)
        offset = np.array(self.caches[0].offset)
        for slot, row in placed:
            padding[slot] = columns - lengths[row]
            offset[slot] = lengths[row]
        padding_mx, offset_mx = mx.array(padding), mx.array(offset)
        for mine, theirs in zip(self.caches, caches, strict=True):
            assert mine.keys is not None and mine.values is not None
            assert theirs.keys is not None and theirs.values is not None
            end = theirs.size()
            for slot, row in placed:
                n = lengths[row]
                mine.keys[slot : slot + 1, :, columns - n : columns, :] = theirs.keys[
                    row : row + 1, :, end - n : end, :
                ]
                mine.values[slot : slot + 1, :, columns - n : columns, :] = theirs.values[
                    row : row + 1, :, end - n : end, :
                ]
            mine.left_padding, mine.offset = padding_mx, offset_mx

    def _append(self, caches: Sequence[BatchKVCache], rows: list[int]) -> None:
        """Grow the batch by `rows` of the joining caches: one new buffer, both right-aligned.

        (mlx-lm's `BatchKVCache.extend` pads both sides and concatenates: three copies.)
        """
        index = mx.array(rows, dtype=mx.int32)
        for mine, theirs in zip(self.caches, caches, strict=True):
            assert mine.keys is not None and mine.values is not None
            assert theirs.keys is not None and theirs.values is not None
            ours, joining = mine.size(), theirs.size()
            columns = max(ours, joining)
            capacity = -(-columns // mine.step) * mine.step  # room for the next tokens
            old = mine.keys.shape[0]
            grown = []
            for mine_kv, theirs_kv in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                _, heads, _, dim = mine_kv.shape
                both = mx.zeros((old + len(rows), heads, capacity, dim), dtype=mine_kv.dtype)
                both[:old, :, columns - ours : columns, :] = mine_kv[..., :ours, :]
                both[old:, :, columns - joining : columns, :] = theirs_kv[index, :, :joining, :]
                grown.append(both)
            keys, values = grown
            left_padding = mx.concatenate(
                [
                    mine.left_padding + (columns - ours),
                    theirs.left_padding[index] + (columns - joining),
                ]
            )
            offset = mx.concatenate([mine.offset, theirs.offset[index]])
            mine.state = (keys, values, offset, left_padding, columns)

    def drop(self, ended: np.ndarray) -> None:
        """Free the slots of rows that ended (a boolean mask over slots)."""
        if not ended.any():
            return
        self.stream_ids[ended] = FREE
        for slot in np.flatnonzero(ended).tolist():
            self.samplers[slot] = _GREEDY
        live = int(np.count_nonzero(self.stream_ids))
        if live == 0:
            self._empty()
        elif len(self.stream_ids) - live > live:
            self._compact()
        else:
            self._trim()

    def _compact(self) -> None:
        """Keep only the live rows (copies them)."""
        rows = np.flatnonzero(self.live)
        index = mx.array(rows.astype(np.int32))
        for cache in self.caches:
            cache.filter(index)
            _own_buffers(cache)
        self.stream_ids = self.stream_ids[rows]
        self.samplers = [self.samplers[i] for i in rows]
        self.inputs = self.inputs[index]

    def _trim(self) -> None:
        """Drop the leftmost columns once no live row uses them (they only cost attention)."""
        padding = np.array(self.caches[0].left_padding)
        unused = int(padding[self.live].min())
        if unused < TRIM_COLUMNS:
            return
        padding_mx = mx.array(np.maximum(padding - unused, 0))
        for cache in self.caches:
            keys, values, offset, _, columns = cache.state
            assert keys is not None and values is not None
            cache.state = (
                keys[..., unused:, :],
                values[..., unused:, :],
                offset,
                padding_mx,
                columns - unused,
            )
            _own_buffers(cache)


def _own_buffers(cache: BatchKVCache) -> None:
    """A column slice is a strided view; writing the next token into a view copies the whole
    array every step, so make the keys/values contiguous once."""
    assert cache.keys is not None and cache.values is not None
    cache.keys = mx.contiguous(cache.keys)
    cache.values = mx.contiguous(cache.values)


def _rows_of(cache: BatchKVCache, rows: list[int]) -> BatchKVCache:
    """The joining cache itself if it is all `rows`, else a copy of just those rows."""
    assert cache.keys is not None
    if rows == list(range(cache.keys.shape[0])):
        return cache
    return BatchKVCache.merge([cache.extract(row) for row in rows])


def one_row(cache: KVCache) -> BatchKVCache:
    """One prompt's cache copied into a one-row batch cache, with room for the next tokens.

    (`BatchKVCache.merge` leaves no room, so the first decode step would copy it again to grow
    it: ~0.1 s for a 1,500-token prompt.)
    """
    assert cache.keys is not None and cache.values is not None
    length = cache.offset
    capacity = -(-(length + 1) // cache.step) * cache.step
    keys, values = (_with_room(kv[..., :length, :], capacity) for kv in (cache.keys, cache.values))
    row = BatchKVCache([0])
    row.state = (keys, values, mx.array([length]), row.left_padding, length)
    return row


def _with_room(kv: mx.array, capacity: int) -> mx.array:
    """`kv` followed by zeros up to `capacity` columns."""
    batch, heads, columns, dim = kv.shape
    room = mx.zeros((batch, heads, capacity - columns, dim), dtype=kv.dtype)
    return mx.concatenate([kv, room], axis=2)
