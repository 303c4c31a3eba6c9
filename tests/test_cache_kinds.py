"""engine/cache_kinds.py: a prompt's caches as they join the decode batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxgate.engine import cache_kinds

PROMPT = 300  # tokens: KVCache's buffers grow by 256 columns, so these have room for more


def _prompt_cache(kind: type) -> KVCache | QuantizedKVCache:
    cache = kind() if kind is KVCache else kind(group_size=64, bits=8)
    keys = mx.random.normal((1, 3, PROMPT, 64), key=mx.random.key(0))
    cache.update_and_fetch(keys, keys * 2)
    mx.eval(cache_kinds.arrays(cache))
    return cache


@pytest.mark.parametrize("kind", [KVCache, QuantizedKVCache])
def test_a_joining_row_shares_its_prompts_buffers_and_keeps_its_writes_to_itself(
    kind: type,
) -> None:
    """The row takes the prefill's buffers without a copy (a long prompt's join stalled every
    decoding stream for the copy: ~0.2 s at 10k tokens); what the batch then writes does not reach
    the prompt's cache (another prompt may still start from it)."""
    cache = _prompt_cache(kind)
    before = [np.array(a) for a in cache_kinds.arrays(cache)]
    active = mx.get_active_memory()
    row = cache_kinds.batch_of_one(cache)
    mx.eval(cache_kinds.arrays(row))
    assert mx.get_active_memory() - active < cache_kinds.nbytes(cache) / 10

    token = mx.ones((1, 3, 1, 64))
    keys, _ = row.update_and_fetch(token, token)
    mx.eval(keys)
    assert int(row.offset[0]) == PROMPT + 1
    after = [np.array(a) for a in cache_kinds.arrays(cache)]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)
    assert cache.offset == PROMPT


WINDOW = 8


def _window_of(length: int) -> RotatingKVCache:
    """A prompt's sliding window over `length` tokens (prefilled in one pass), each token's key
    its position."""
    cache = RotatingKVCache(WINDOW)
    positions = mx.arange(length, dtype=mx.float32).reshape(1, 1, length, 1)
    cache.update_and_fetch(positions, positions)
    return cache


def _attended(batch: BatchRotatingKVCache, first: list[int], n: int) -> list[list[list[int]]]:
    """A pass of `n` tokens per row (row r's at positions first[r]...): per row and query, the
    positions of the keys its mask lets it attend to (each key is its own position)."""
    mask = batch.make_mask(n, window_size=WINDOW)
    new = mx.array([[list(range(p, p + n))] for p in first], dtype=mx.float32)[..., None]
    keys, _ = batch.update_and_fetch(new, new)
    keys = np.array(keys)[:, 0, :, 0]
    mask = np.broadcast_to(np.array(mask), (len(first), 1, n, keys.shape[1]))
    return [
        [sorted(keys[r][mask[r, 0, q]].astype(int).tolist()) for q in range(n)]
        for r in range(len(first))
    ]


def _windows(first: list[int], n: int) -> list[list[list[int]]]:
    """What one sequence's window attends to from each of those positions: the last WINDOW."""
    return [[list(range(max(0, p - WINDOW + 1), p + 1)) for p in range(f, f + n)] for f in first]


def test_a_window_takes_back_rejected_guesses_and_verifies_after_rotating() -> None:
    """Speculation over sliding windows: rows of 3 and 11 tokens (one padded) decode until the
    window rotates, then verify passes of three positions keep some guesses and not others; at
    every step each query attends to exactly its last WINDOW positions, as one sequence does."""
    batch = cache_kinds.merge([_window_of(3), _window_of(11)])
    length = [3, 11]

    def step(n: int) -> None:
        assert _attended(batch, length, n) == _windows(length, n)

    for _ in range(3):  # decode steps write in place: the window rotates
        step(1)
        length = [p + 1 for p in length]
    assert batch.rotated
    for kept in ([1, 0], [0, 2], [2, 2], [0, 0]):  # guesses each row keeps of two
        cache_kinds.in_temporal_order(batch)
        step(3)
        columns = np.array(kept) + 1
        cache_kinds.rewind(batch, columns, 3)
        length = [p + int(c) for p, c in zip(length, columns, strict=True)]
        if kept != [2, 2]:  # a decode step after this pass (after the other: another pass)
            step(1)
            length = [p + 1 for p in length]
