"""engine/cache_kinds.py: a prompt's caches as they join the decode batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

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
