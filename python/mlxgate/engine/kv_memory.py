"""The KV cache's memory budget: what a sequence's caches cost, and what the engine may hold.

A sequence's caches cost a fixed part (recurrent states, sliding windows at their full size) and
a part per token (attention keys and values, allocated by mlx-lm 256 columns at a time). The
engine admits a prompt to prefill only while what it holds plus the prompt's reservation fits
the budget, and preempts decoding rows when their growth would outgrow it (engine/decoder.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxgate.engine import cache_kinds
from mlxgate.engine.lockstep import Lockstep
from mlxgate.engine.prefix_cache import entry_bytes
from mlxgate.engine.settings import EngineSettings
from mlxgate.models.adapter import ModelAdapter

# mlx-lm grows a keys/values buffer by this many columns at a time.
COLUMNS_STEP = 256
# Of the memory left after the weights, the share the KV cache may take by default: the rest is
# for the prefix cache, activations, the heap's slack and the rest of the machine.
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class KVMemory:
    budget: int  # bytes the running and prefilling sequences' caches may hold
    token_bytes: int  # attention keys and values of one token, every layer
    fixed_bytes: int  # a sequence's state that does not grow with it (windows, recurrent states)

    @classmethod
    def of(cls, caches: Sequence[Any], budget: int) -> KVMemory:
        """The costs of a model's caches (`caches`: one sequence's, after a prefill)."""
        token = fixed = 0
        for leaf in [leaf for cache in caches for leaf in cache_kinds.leaves(cache)]:
            if type(leaf) is KVCache:
                assert leaf.keys is not None and leaf.values is not None
                token += (leaf.keys.nbytes + leaf.values.nbytes) // leaf.keys.shape[2]
            elif type(leaf) is QuantizedKVCache:  # keys, values: (packed, scales, biases)
                parts: list[Any] = [*leaf.keys, *leaf.values]  # type: ignore[misc]
                token += sum(part.nbytes for part in parts) // parts[0].shape[-2]
            elif type(leaf) is RotatingKVCache:
                assert leaf.keys is not None and leaf.values is not None
                per_token = (leaf.keys.nbytes + leaf.values.nbytes) // leaf.keys.shape[2]
                fixed += per_token * leaf.max_size
            elif isinstance(leaf, ArraysCache):
                states: list[Any] = leaf.cache
                fixed += sum(state.nbytes for state in states if state is not None)
        return cls(budget, token, fixed)

    def need(self, tokens: int) -> int:
        """The bytes a sequence of `tokens` tokens holds once its buffers have room for them."""
        columns = -(-tokens // COLUMNS_STEP) * COLUMNS_STEP
        return self.fixed_bytes + columns * self.token_bytes

    def reserve(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """What a sequence takes from the budget when it starts: its prompt, and room for its
        output up to one more buffer step (beyond that, preemption keeps the budget)."""
        return self.need(prompt_tokens + min(max_tokens or COLUMNS_STEP, COLUMNS_STEP))

    def most_tokens(self) -> int:
        """The longest sequence whose caches fit the budget alone."""
        if self.token_bytes == 0:
            return 2**62
        room = self.budget - self.fixed_bytes
        return max(0, room // self.token_bytes // COLUMNS_STEP * COLUMNS_STEP)


def default_budget(weights_bytes: int, prefix_cache_bytes: int) -> int:
    """A share of the machine's memory after the weights (as MLX counts them) and the prefix
    cache's own budget."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, int((total - weights_bytes) * DEFAULT_SHARE) - prefix_cache_bytes)


def measured(
    adapter: ModelAdapter, settings: EngineSettings, lockstep: Lockstep, sizes: EntrySizes
) -> KVMemory:
    """What a sequence's caches cost (measured on a one-token prefill), and the budget: rank 0's,
    on every rank (and `sizes` learns whether the ranks' entries differ)."""
    caches = adapter.make_cache()
    adapter.prefill(mx.array([[0]], dtype=mx.uint32), caches)
    if settings.kv_memory_gb > 0:
        budget = int(settings.kv_memory_gb * 2**30)
    else:
        budget = default_budget(mx.get_active_memory(), settings.prefix_cache_mb << 20)
    own = KVMemory.of(caches, budget)
    memory = lockstep.share(lambda: own, dataclasses.astuple, lambda v: KVMemory(*v))
    sizes.agree(memory, own)
    return memory


class EntrySizes:
    """A prefix cache entry's bytes, the same on every rank (so that their evictions agree)."""

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep = lockstep
        self.shared = False  # whether each entry's size is rank 0's

    def agree(self, memory: KVMemory, own: KVMemory) -> None:
        """Shards of the same size (tensor parallel) store entries of the same size: each rank
        measures its own. Otherwise (pipeline parallel: runs of layers) rank 0's sizes count."""
        differ = (memory.token_bytes, memory.fixed_bytes) != (own.token_bytes, own.fixed_bytes)
        self.shared = self.lockstep.any(differ)

    def __call__(self, caches: list[Any]) -> int:
        if not self.shared:
            return entry_bytes(caches)
        return self.lockstep.share(lambda: entry_bytes(caches))
