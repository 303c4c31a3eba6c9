"""What the engine does with each kind of layer cache an mlx-lm model makes.

A model says what each layer keeps through `make_cache()`: full attention keys/values
(`KVCache`), a sliding window of them (`RotatingKVCache`), a recurrent or convolution state
(`ArraysCache`, for linear-attention and SSM layers), or several of these (`CacheList`). Each
has a batched form in mlx-lm (`BatchKVCache`, `BatchRotatingKVCache`; `ArraysCache` batches
itself) with `merge`, `extend`, `filter` and `extract`; the engine uses those, and its own
faster copies only where it has them (attention keys/values).

With `--kv-bits`, plain attention layers keep their keys/values quantized (mlx-lm's
`QuantizedKVCache`, batched as engine/quantized_kv.py's `BatchQuantizedKVCache`): each of keys
and values is then a triple of arrays (packed, scales, biases) that every copy below moves alike.

What a kind allows:
- a row can be written into a free slot of the batch: attention and recurrent state, not a
  rotated window (its rows share one write position);
- a cached prefix can be cut at any token: attention keys/values only. A window or a state
  holds exactly the tokens it has seen, so it is reused only whole (a snapshot);
- the positions of rejected guesses taken back (speculative decoding): attention keys/values,
  and sliding windows. A verify pass writes a window's keys/values in temporal order and keeps
  every one it evicts until the next step (mlx-lm's window holds `max_size - 1` tokens before
  a pass of several), so cutting its last positions leaves the window it had. A recurrent
  state is overwritten in place; a gated delta layer's (Qwen3-Next, Qwen3.5) is restored from
  what the pass recorded (models/recurrent_guesses.py), other recurrent layers turn
  speculation off.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxgate.engine.quantized_kv import BatchQuantizedKVCache

# Attention keys/values, float or quantized: one sequence's and a batch's.
_ATTENTION = (KVCache, QuantizedKVCache)
_BATCH_ATTENTION = (BatchKVCache, BatchQuantizedKVCache)

# Single-sequence cache kinds the engine batches, by what their layers do.
_LAYER_NAMES: dict[type, str] = {
    KVCache: "attention",
    QuantizedKVCache: "attention",
    RotatingKVCache: "sliding-window attention",
    ArraysCache: "recurrent",
}


class UnsupportedCache(TypeError):
    """A model keeps a layer cache the engine cannot batch."""


@dataclass(frozen=True)
class CacheLayout:
    """The cache kinds of one model's layers, worked out once from `model.make_cache()`."""

    kinds: tuple[str, ...]  # per layer, e.g. "attention", "recurrent", "attention+recurrent"
    attention_layer: int | None  # a layer with plain attention keys/values, if any
    cuttable: bool  # a cached prefix can be cut at any token (attention layers only)
    rewindable: bool  # rejected guesses can be taken back (attention, windows, watched states)
    slots: bool  # rows can be written into free slots of the batch (no sliding windows)

    @classmethod
    def of(cls, caches: Sequence[Any], watched: int = 0) -> CacheLayout:
        """The layout of a model's caches; `watched`: how many of its recurrent layers record
        verify passes (models/recurrent_guesses.py), which makes them rewindable if all do."""
        kinds = tuple(_kind(cache) for cache in caches)
        singles = [leaf for cache in caches for leaf in leaves(cache)]
        recurrent = sum(isinstance(leaf, ArraysCache) for leaf in singles)
        attention = [i for i, cache in enumerate(caches) if type(cache) in _ATTENTION]
        return cls(
            kinds=kinds,
            attention_layer=attention[0] if attention else None,
            cuttable=all(type(leaf) in _ATTENTION for leaf in singles),
            rewindable=recurrent <= watched
            and all(type(leaf) in (*_ATTENTION, RotatingKVCache, ArraysCache) for leaf in singles),
            slots=not any(isinstance(leaf, RotatingKVCache) for leaf in singles),
        )

    @property
    def all_attention(self) -> bool:
        return all(kind == "attention" for kind in self.kinds)

    def describe(self) -> str:
        """e.g. "36 layers: 27 recurrent, 9 attention"."""
        counts = Counter(self.kinds)
        if len(counts) == 1:
            return f"{len(self.kinds)} {self.kinds[0]} layers"
        parts = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
        return f"{len(self.kinds)} layers: {parts}"

    def reuse(self) -> str:
        """What the prefix cache can reuse for this model, in words."""
        if self.cuttable:
            return "any shared prefix"
        return "whole snapshots (a window or recurrent state cannot be cut)"


def _kind(cache: Any) -> str:
    if type(cache) is CacheList:
        return "+".join(_kind(sub) for sub in cache.caches)
    if (name := _LAYER_NAMES.get(type(cache))) is not None:
        return name
    raise UnsupportedCache(
        f"the model keeps a {type(cache).__name__} per layer, which mlxgate cannot batch yet "
        f"(it batches {', '.join(c.__name__ for c in _LAYER_NAMES)} and CacheList of those)"
    )


def leaves(cache: Any) -> list[Any]:
    """The single caches a layer's cache is made of (a CacheList's, or itself)."""
    if type(cache) is CacheList:
        return [leaf for sub in cache.caches for leaf in leaves(sub)]
    return [cache]


def arrays(cache: Any) -> list[mx.array]:
    """Every array a (batch or single) cache holds, to evaluate."""
    leaves: list[tuple[str, Any]] = tree_flatten(cache.state)  # type: ignore[assignment]
    return [leaf for _, leaf in leaves if isinstance(leaf, mx.array)]


def merge(caches: Sequence[Any]) -> Any:
    """One batch cache over single-sequence `caches` of one layer (mlx-lm's own merge)."""
    if type(caches[0]) is QuantizedKVCache:
        return BatchQuantizedKVCache.merge(list(caches))
    return type(caches[0]).merge(list(caches))


def batch_of_one(cache: Any) -> Any:
    """A single sequence's cache as a one-row batch cache."""
    if type(cache) in _ATTENTION:
        return _kv_row(cache)
    if type(cache) is CacheList:
        return CacheList(*(batch_of_one(sub) for sub in cache.caches))
    return merge([cache])


def batch_of(cache: Any, rows: int) -> Any:
    """A single sequence's cache as a batch cache of `rows` identical rows, each its own copy
    (the choices of one prompt)."""
    batch = batch_of_one(cache)
    for _ in range(rows - 1):
        append_rows(batch, batch_of_one(cache), [0])
    return batch


def _kv_row(cache: KVCache | QuantizedKVCache) -> Any:
    """A one-row batch cache with room for the next tokens (`BatchKVCache.merge` leaves none, so
    the first decode step would copy it again to grow it: ~0.1 s for a 1,500-token prompt).

    A prefill's buffers have room already (KVCache grows by 256 columns): their data is shared,
    not copied (a copy of a 10k-token prompt's keys and values takes ~0.2 s here, a stall for
    every stream decoding beside its join). The row's arrays are new objects (MLX writes in
    place into the object a cache holds: `snapshot`), and the batch's first write copies the
    data only if `cache` is still alive then."""
    assert cache.keys is not None and cache.values is not None
    length = cache.offset
    if capacity(cache) > length:
        keys, values = (_each(lambda a: a[...], kv) for kv in (cache.keys, cache.values))
    else:
        room = -(-(length + 1) // cache.step) * cache.step
        keys, values = (
            _each(lambda a: _with_room(a[..., :length, :], room), kv)
            for kv in (cache.keys, cache.values)
        )
    row = _batch_of_kind(cache)
    row.state = (keys, values, mx.array([length]), row.left_padding, length)
    return row


def _batch_of_kind(cache: KVCache | QuantizedKVCache) -> Any:
    """An empty one-row batch cache of the kind of single-sequence `cache`."""
    if type(cache) is QuantizedKVCache:
        return BatchQuantizedKVCache([0], cache.group_size, cache.bits)
    return BatchKVCache([0])


def _each(f: Any, kv: Any) -> Any:
    """`f` applied to keys (or values): a float array, or each array of a quantized triple."""
    return tuple(f(a) for a in kv) if isinstance(kv, tuple) else f(kv)


def capacity(cache: Any) -> int:
    """The columns an attention cache's buffers have room for (0 before any)."""
    return 0 if cache.keys is None else int(_parts(cache)[0].shape[2])


def _parts(cache: Any) -> list[mx.array]:
    """The arrays of an attention cache's keys then values (two, or two triples)."""
    return [a for kv in (cache.keys, cache.values) for a in (kv if isinstance(kv, tuple) else [kv])]


def _from_parts(cache: Any, parts: list[mx.array]) -> tuple[Any, Any]:
    """(keys, values) of `cache`'s kind made of `parts` (as `_parts` lists them)."""
    if isinstance(cache.keys, tuple):
        return tuple(parts[:3]), tuple(parts[3:])
    return parts[0], parts[1]


def _with_room(kv: mx.array, capacity: int) -> mx.array:
    batch, heads, columns, dim = kv.shape
    room = mx.zeros((batch, heads, capacity - columns, dim), dtype=kv.dtype)
    return mx.concatenate([kv, room], axis=2)


def append_rows(mine: Any, theirs: Any, rows: list[int]) -> None:
    """Grow batch cache `mine` by `rows` of batch cache `theirs` (in place)."""
    if type(mine) in _BATCH_ATTENTION:
        _kv_append(mine, theirs, rows)
    elif type(mine) is CacheList:
        for a, b in zip(mine.caches, theirs.caches, strict=True):
            append_rows(a, b, rows)
    else:
        mine.extend(_rows_copy(theirs, rows))


def _rows_copy(cache: Any, rows: list[int]) -> Any:
    """A batch cache holding just `rows` of `cache` (mlx-lm's extend may reorder its argument;
    `filter` rebinds every attribute it changes, so a shallow copy is enough)."""
    out = copy.copy(cache)
    out.filter(mx.array(rows, dtype=mx.int32))
    return out


def _kv_append(mine: Any, theirs: Any, rows: list[int]) -> None:
    """One new buffer, both parts right-aligned (mlx-lm's `extend` pads both sides and
    concatenates: three copies)."""
    assert mine.keys is not None and mine.values is not None
    assert theirs.keys is not None and theirs.values is not None
    index = mx.array(rows, dtype=mx.int32)
    ours, joining = mine.size(), theirs.size()
    columns = max(ours, joining)
    capacity = -(-columns // mine.step) * mine.step  # room for the next tokens
    old = mine.offset.shape[0]
    grown = []
    for mine_kv, theirs_kv in zip(_parts(mine), _parts(theirs), strict=True):
        _, heads, _, dim = mine_kv.shape
        both = mx.zeros((old + len(rows), heads, capacity, dim), dtype=mine_kv.dtype)
        both[:old, :, columns - ours : columns, :] = mine_kv[..., :ours, :]
        both[old:, :, columns - joining : columns, :] = theirs_kv[index, :, :joining, :]
        grown.append(both)
    keys, values = _from_parts(mine, grown)
    left_padding = mx.concatenate(
        [mine.left_padding + (columns - ours), theirs.left_padding[index] + (columns - joining)]
    )
    offset = mx.concatenate([mine.offset, theirs.offset[index]])
    mine.state = (keys, values, offset, left_padding, columns)


def write_slots(
    mine: Any,
    theirs: Any,
    placed: list[tuple[int, int]],
    lengths: Sequence[int],
    padding: mx.array,
    offset: mx.array,
) -> None:
    """Copy joining rows of `theirs` into free slots of `mine`: (slot, row) pairs, in place.

    Attention rows are right-aligned with the batch: `lengths[row]` tokens end at its last
    column, and `padding`/`offset` are the band's per-slot arrays after the write.
    """
    if type(mine) in _BATCH_ATTENTION:
        assert mine.keys is not None and mine.values is not None
        assert theirs.keys is not None and theirs.values is not None
        columns, end = mine.size(), theirs.size()
        for slot, row in placed:
            n = lengths[row]
            for part, joining in zip(_parts(mine), _parts(theirs), strict=True):
                part[slot : slot + 1, :, columns - n : columns, :] = joining[
                    row : row + 1, :, end - n : end, :
                ]
        mine.left_padding, mine.offset = padding, offset
    elif type(mine) is CacheList:
        for a, b in zip(mine.caches, theirs.caches, strict=True):
            write_slots(a, b, placed, lengths, padding, offset)
    elif isinstance(mine, ArraysCache):
        for state, joining in zip(mine.cache, theirs.cache, strict=True):
            assert state is not None and joining is not None
            for slot, row in placed:
                state[slot : slot + 1] = joining[row : row + 1]
    else:
        raise UnsupportedCache(f"{type(mine).__name__} rows cannot be written into slots")


def keep_rows(cache: Any, index: mx.array) -> None:
    """Keep only the rows `index` of a batch cache (copies them; contiguous buffers)."""
    cache.filter(index)
    for leaf in leaves(cache):
        if type(leaf) in _BATCH_ATTENTION:
            own_buffers(leaf)


def own_buffers(cache: Any) -> None:
    """A column slice is a strided view; writing the next token into a view copies the whole
    array every step, so make the keys/values contiguous once."""
    assert cache.keys is not None and cache.values is not None
    cache.keys = _each(mx.contiguous, cache.keys)
    cache.values = _each(mx.contiguous, cache.values)


def drop_columns(cache: Any, unused: int, padding: mx.array) -> None:
    """Drop the leftmost `unused` columns of attention keys/values (no live row uses them)."""
    for leaf in leaves(cache):
        if type(leaf) in _BATCH_ATTENTION:
            keys, values, offset, _, columns = leaf.state
            assert keys is not None and values is not None
            leaf.state = (
                _each(lambda a: a[..., unused:, :], keys),
                _each(lambda a: a[..., unused:, :], values),
                offset,
                padding,
                columns - unused,
            )
            own_buffers(leaf)


def in_temporal_order(cache: Any) -> None:
    """Before a verify pass: a sliding window rotated by decode steps put back in temporal order,
    as the pass's write will put it. (mlx-lm's window works out the pass's mask before that
    write, from its rotated state, one column off for rows still padded.)"""
    for leaf in leaves(cache):
        if type(leaf) is BatchRotatingKVCache:
            leaf._temporal_order()


def rewind(
    cache: Any, columns: np.ndarray, width: int, states: Iterator[Any] | None = None
) -> None:
    """After a verify pass of `width` columns a row, each row keeps `columns[row]` of them.
    Attention keys/values and sliding windows (which the pass left in temporal order) lose the
    last `width - most` columns of every row (`most`: the most any row keeps), and a row that
    kept fewer has its columns moved right over its rejected ones (its left padding grows by as
    much). A recurrent state is restored from the pass's record of its layer (`states`: one a
    recurrent layer, in layer order; models/recurrent_guesses.py)."""
    most = int(columns.max())
    surplus, shift = width - most, most - columns
    rows = np.flatnonzero(shift).tolist()
    for leaf in leaves(cache):
        if isinstance(leaf, ArraysCache):
            if states is None:
                raise UnsupportedCache("a recurrent state takes back positions only from a record")
            recorded = next(states)
            if int(columns.min()) < width:  # else the pass's own state is the one kept
                recorded.restore(leaf, mx.array(columns))
                # Computed now, so that the verify pass's step is priced with it (the scheduler
                # weighs guesses by what their steps took).
                mx.eval(leaf.cache)
            continue
        if type(leaf) is BatchRotatingKVCache:
            _cut_window(leaf, surplus)
        elif type(leaf) not in _BATCH_ATTENTION:
            raise UnsupportedCache(f"a {type(leaf).__name__} cannot take back positions")
        else:
            leaf.trim(surplus)
        if not rows:
            continue
        assert leaf.keys is not None and leaf.values is not None
        end = leaf._idx
        for row in rows:
            n = int(shift[row])
            for kv in _parts(leaf):
                kv[row : row + 1, :, n:end, :] = kv[row : row + 1, :, : end - n, :]
        moved = mx.array(shift.astype(np.int32))
        leaf.left_padding = leaf.left_padding + moved
        leaf.offset = leaf.offset - moved


def _cut_window(window: BatchRotatingKVCache, surplus: int) -> None:
    """A window's last `surplus` columns dropped. Its buffer is cut too: the next decode step
    takes the buffer's end for the window's, and writes over its oldest column."""
    if not surplus:
        return
    assert not window.rotated and window.keys is not None and window.values is not None
    window.trim(surplus)
    window.keys = window.keys[..., : window._idx, :]
    window.values = window.values[..., : window._idx, :]


def snapshot(cache: Any, *, owned: bool = False) -> Any:
    """A copy of a single-sequence cache that later writes to either side do not reach.

    MLX writes in place into the array object a cache holds (`keys[..., i, :] = k`), so each
    array gets a new object; the data itself is shared until one side writes. An `owned`
    snapshot (one to keep) holds exactly its own data instead: a prefill's keys/values buffer has
    room for up to 255 more tokens (KVCache grows by 256 columns), a batch's recurrent state has
    every row, and a view keeps all of it alive, uncounted (3.7x the bytes of a 70-token prompt).
    """
    if type(cache) is CacheList:
        return CacheList(*(snapshot(sub, owned=owned) for sub in cache.caches))
    take = mx.contiguous if owned else (lambda a: a[...])
    if type(cache) in _ATTENTION:
        out = cut(cache, cache.offset)
        out.keys, out.values = _each(take, out.keys), _each(take, out.values)
        return out
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            setattr(out, name, take(value))
        elif isinstance(value, list):
            setattr(out, name, [take(v) if isinstance(v, mx.array) else v for v in value])
    return out


def cut(cache: Any, length: int) -> Any:
    """A new single-sequence cache of attention layers (a CacheList of them too) holding the
    first `length` tokens of `cache`."""
    if type(cache) is CacheList:
        return CacheList(*(cut(sub, length) for sub in cache.caches))
    assert cache.keys is not None and cache.values is not None
    out = (
        QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        if type(cache) is QuantizedKVCache
        else KVCache()
    )
    out.keys = _each(lambda a: a[..., :length, :], cache.keys)
    out.values = _each(lambda a: a[..., :length, :], cache.values)
    out.offset = length
    return out


def nbytes(cache: Any) -> int:
    return sum(a.nbytes for a in arrays(cache))


def rows(cache: Any) -> int:
    """The number of rows of a batch cache."""
    if type(cache) is CacheList:
        return rows(cache.caches[0])
    if isinstance(cache, ArraysCache):
        return int(cache.batch_size)
    return int(cache.offset.shape[0])
