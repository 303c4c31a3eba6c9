"""The running batch: one row (slot) per decoding sequence, its KV caches, input and sampler.

Rows live in bands of similar length, each band one `BatchKVCache` per layer whose rows are
left-padded to the band's width. A 1,500-token row joining rows of 200 tokens starts a band of
its own: in one shared cache it would pad every row to 1,500 columns (a ~0.3 s copy to join,
then attention over the padding at every step). All bands go through the model in one call;
only attention sees them apart (engine/banded_cache.py).

Copying a band's whole KV cache costs ~0.15 s at 32 rows, so rows are slots: a sequence that
ends leaves its slot (still computed, its tokens ignored) until a joining sequence is written
into it, and a band is only compacted once more of its slots are free than in use.

Layers keep whatever their kind needs (engine/cache_kinds.py): bands of different widths need
every layer to be attention, and a free slot takes a joining row only where no layer is a
sliding window (whose rows share one write position); there joining rows are appended, and free
slots wait for the compaction like any others.

The rows' samplers are kept here, slot by slot; a step samples with them in
engine/batch_sampler.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxgate.engine import cache_kinds
from mlxgate.engine.banded_cache import BandedCache
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.contract import SamplingParams
from mlxgate.engine.sampling import Sampler

FREE = 0  # the stream id of a free slot (stream ids start at 1)
# Columns no live row uses (all pad them) before the cache is shifted to drop them: at 32 rows
# each column costs ~0.35 ms of attention per step, a shift one copy of the cache (~0.13 s).
TRIM_COLUMNS = 32
# A joining row starts a new band when the closest band would need more padding than this many
# row-columns to take it: each costs a little attention at every step, a band ~5 ms of extra ops.
BAND_PADDING = 512
MAX_BANDS = 4

GREEDY = Sampler(SamplingParams())  # a free slot's, and every draft-model row's


class DecodeBatch:
    """The bands, seen as one batch: rows (slots) in band order."""

    def __init__(self, layout: CacheLayout, banded: bool = True) -> None:
        self.layout = layout
        self.max_bands = MAX_BANDS if banded and layout.all_attention else 1
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
    def scaled(self) -> np.ndarray:
        """Per slot: whether its sequence is served with the scaled rope (models/rope_switch.py)."""
        if not self.bands:
            return np.zeros(0, dtype=np.bool_)
        return np.concatenate([band.scaled for band in self.bands])

    @property
    def samplers(self) -> list[Sampler]:
        """Per slot (a free slot's is greedy)."""
        return list(itertools.chain.from_iterable(band.samplers for band in self.bands))

    @property
    def inputs(self) -> mx.array:
        """The token each slot feeds next."""
        if len(self.bands) == 1:
            return self.bands[0].inputs
        return mx.concatenate([band.inputs for band in self.bands])

    @property
    def caches(self) -> list[Any]:
        """Per layer: the one band's batch cache, or a BandedCache over all bands."""
        if len(self.bands) == 1:
            return self.bands[0].caches
        return BandedCache.per_layer([band.caches for band in self.bands])

    def add(
        self,
        caches: Sequence[Any],
        lengths: Sequence[int],
        stream_ids: Sequence[int],
        samplers: Sequence[Sampler],
        inputs: Sequence[int],
        scaled: Sequence[bool] | None = None,
    ) -> None:
        """Join rows whose `lengths` tokens `caches` hold (per layer, a batch cache; attention
        rows left-padded to its end); `scaled` says which use the scaled rope (None: none)."""
        scaled = scaled if scaled is not None else [False] * len(lengths)
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
                bands.append(_Band(self.layout))
                widths.append(length)
                slots.append(1)
                rows.append([row])
                continue
            rows[best].append(row)
            widths[best] = max(widths[best], length)
            slots[best] += 1
        for band, band_rows in zip(bands, rows, strict=True):
            if band_rows:
                band.add(caches, lengths, sorted(band_rows), stream_ids, samplers, inputs, scaled)
        self.bands = bands
        # The copies are paid now, by the step that admits, not by the next decode step.
        mx.eval([cache_kinds.arrays(c) for band in bands for c in band.caches])

    def extract(self, stream_id: int) -> list[Any]:
        """A copy of one row's caches, per layer a single-sequence cache (padding left out)."""
        for band in self.bands:
            slots = np.flatnonzero(band.stream_ids == stream_id)
            if len(slots):
                return [cache.extract(int(slots[0])) for cache in band.caches]
        raise KeyError(stream_id)

    def kv_bytes(self) -> int:
        """The bytes the bands' caches hold (free slots, padding and room for growth included)."""
        return sum(cache_kinds.nbytes(c) for band in self.bands for c in band.caches)

    def growth_bytes(self, width: int, token_bytes: int) -> int:
        """The bytes the bands' attention caches add when the next step writes `width` more
        columns: a band whose buffer is full grows by mlx-lm's step (256 columns) for every slot."""
        grown = 0
        for band in self.bands:
            attention = band._attention
            if attention is not None and attention._idx + width > cache_kinds.capacity(attention):
                steps = -(-width // attention.step)
                grown += len(band.stream_ids) * steps * attention.step * token_bytes
        return grown

    def drop(self, ended: np.ndarray, compact: bool = False) -> None:
        """Free the slots of rows that ended (a boolean mask over slots); `compact`: give their
        memory back now (copies the rest of their bands)."""
        if not ended.any():
            return
        start = 0
        for band in self.bands:
            stop = start + len(band.stream_ids)
            band.drop(ended[start:stop], compact)
            start = stop
        self.bands = [band for band in self.bands if len(band)]

    def advance(self, tokens: mx.array) -> None:
        """Feed each slot `tokens[slot]` next."""
        start = 0
        for band in self.bands:
            stop = start + len(band.stream_ids)
            band.inputs = tokens[start:stop] if len(self.bands) > 1 else tokens
            start = stop

    def in_temporal_order(self) -> None:
        """Before a verify pass: its sliding windows put back in temporal order."""
        for band in self.bands:
            for cache in band.caches:
                cache_kinds.in_temporal_order(cache)

    def rewind(self, kept: np.ndarray, width: int, states: Sequence[Any] = ()) -> None:
        """After a verify pass of `width` positions per slot: each slot keeps the keys/values of
        its input and its `kept[slot]` right guesses; the other positions are taken back
        (`states`: the pass's record of its recurrent layers, which keep one band)."""
        start = 0
        recorded = iter(states) if states else None
        for band in self.bands:
            stop = start + len(band.stream_ids)
            band.rewind(kept[start:stop] + 1, width, recorded)
            start = stop


class _Band:
    """Rows sharing one batch cache per layer. Per-slot state lives in numpy arrays, so a
    step's bookkeeping is a few vector operations whatever the number of rows.
    """

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._empty()

    def _empty(self) -> None:
        self.caches: list[Any] = []
        self.stream_ids = np.zeros(0, dtype=np.uint64)  # per slot; FREE when the slot is free
        self.scaled = np.zeros(0, dtype=np.bool_)  # per slot: served with the scaled rope
        self.samplers: list[Sampler] = []
        self.inputs = mx.array([], dtype=mx.uint32)  # the token each slot feeds next

    def __len__(self) -> int:
        return int(np.count_nonzero(self.stream_ids))

    @property
    def live(self) -> np.ndarray:
        return self.stream_ids != FREE

    @property
    def _attention(self) -> Any:
        """An attention layer's cache: its padding and offsets are every attention layer's."""
        layer = self.layout.attention_layer
        return None if layer is None or not self.caches else self.caches[layer]

    @property
    def columns(self) -> int:
        attention = self._attention
        return attention.size() if attention is not None else 0  # type: ignore[no-any-return]

    def add(
        self,
        caches: Sequence[Any],
        lengths: Sequence[int],
        rows: list[int],
        stream_ids: Sequence[int],
        samplers: Sequence[Sampler],
        inputs: Sequence[int],
        scaled: Sequence[bool],
    ) -> None:
        """Join `rows` of the joining `caches` (per layer, rows left-padded to its end; `lengths`
        their tokens): into free slots where they fit, else as new slots."""
        placed: list[tuple[int, int]] = []  # (slot, joining row)
        appended: list[int] = rows
        if not self.caches:
            self.caches = [_rows_of(cache, rows) for cache in caches]
        else:
            columns = self.columns
            free = np.flatnonzero(~self.live).tolist() if self.layout.slots else []
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
            self.scaled[slot] = scaled[row]
            self.samplers[slot] = samplers[row]
        tokens = np.concatenate([tokens, np.asarray([inputs[r] for r in appended], np.uint32)])
        self.inputs = mx.array(tokens)
        self.stream_ids = np.concatenate(
            [self.stream_ids, np.asarray([stream_ids[r] for r in appended], np.uint64)]
        )
        self.scaled = np.concatenate([self.scaled, np.asarray([scaled[r] for r in appended], bool)])
        self.samplers.extend(samplers[r] for r in appended)

    def _write_slots(
        self,
        caches: Sequence[Any],
        placed: list[tuple[int, int]],
        lengths: Sequence[int],
        columns: int,
    ) -> None:
        """Copy joining rows into free slots, attention right-aligned with the batch (in place)."""
        attention = self._attention
        padding = offset = mx.array([])
        if attention is not None:
            padding_np = np.array(attention.left_padding)
            offset_np = np.array(attention.offset)
            for slot, row in placed:
                padding_np[slot] = columns - lengths[row]
                offset_np[slot] = lengths[row]
            padding, offset = mx.array(padding_np), mx.array(offset_np)
        for mine, theirs in zip(self.caches, caches, strict=True):
            cache_kinds.write_slots(mine, theirs, placed, lengths, padding, offset)

    def _append(self, caches: Sequence[Any], rows: list[int]) -> None:
        """Grow the batch by `rows` of the joining caches."""
        for mine, theirs in zip(self.caches, caches, strict=True):
            cache_kinds.append_rows(mine, theirs, rows)

    def rewind(self, columns: np.ndarray, width: int, states: Iterator[Any] | None) -> None:
        """Keep `columns[slot]` of the last pass's `width` columns of each slot."""
        for cache in self.caches:
            cache_kinds.rewind(cache, columns, width, states)
        if (columns != columns.max()).any():
            self._trim()

    def drop(self, ended: np.ndarray, compact: bool = False) -> None:
        """Free the slots of rows that ended (a boolean mask over slots)."""
        if not ended.any():
            return
        self.stream_ids[ended] = FREE
        for slot in np.flatnonzero(ended).tolist():
            self.samplers[slot] = GREEDY
        live = int(np.count_nonzero(self.stream_ids))
        if live == 0:
            self._empty()
        elif compact or len(self.stream_ids) - live > live:
            self._compact()
        else:
            self._trim()

    def _compact(self) -> None:
        """Keep only the live rows (copies them)."""
        rows = np.flatnonzero(self.live)
        index = mx.array(rows.astype(np.int32))
        for cache in self.caches:
            cache_kinds.keep_rows(cache, index)
        self.stream_ids = self.stream_ids[rows]
        self.scaled = self.scaled[rows]
        self.samplers = [self.samplers[i] for i in rows]
        self.inputs = self.inputs[index]

    def _trim(self) -> None:
        """Drop the leftmost columns once no live row uses them (they only cost attention)."""
        attention = self._attention
        if attention is None:
            return
        padding = np.array(attention.left_padding)
        unused = int(padding[self.live].min())
        if unused < TRIM_COLUMNS:
            return
        padding_mx = mx.array(np.maximum(padding - unused, 0))
        for cache in self.caches:
            cache_kinds.drop_columns(cache, unused, padding_mx)


def _rows_of(cache: Any, rows: list[int]) -> Any:
    """The joining cache itself if it is all `rows`, else a copy of just those rows."""
    if rows == list(range(cache_kinds.rows(cache))):
        return cache
    return cache_kinds.merge([cache.extract(row) for row in rows])
