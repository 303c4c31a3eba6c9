"""KV reuse across requests: the longest cached token prefix, bounded by bytes, LRU eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

LayerKV = tuple[mx.array, mx.array]  # keys, values: [1, kv_heads, tokens, head_dim]


@dataclass(frozen=True)
class CacheEntry:
    tokens: np.ndarray  # the token ids whose keys/values `layers` hold, in order
    layers: list[LayerKV]
    nbytes: int


@dataclass(frozen=True)
class PrefixMatch:
    entry: CacheEntry
    length: int  # tokens of the entry reused as the request's prefix

    def caches(self) -> list[KVCache]:
        """Fresh per-layer caches holding the first `length` tokens (engine thread only)."""
        out = []
        for keys, values in self.entry.layers:
            cache = KVCache()
            cache.keys = keys[..., : self.length, :]
            cache.values = values[..., : self.length, :]
            cache.offset = self.length
            out.append(cache)
        return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class PrefixCache:
    """Entries are immutable once stored, so a match stays valid after its entry is evicted.

    `lookup` runs on the event loop (the reused count goes into message_start) and `store` on the
    engine thread; a lock guards the index, never MLX work.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next_key = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixMatch | None:
        """The longest cached prefix of `prompt`, leaving at least one token to compute."""
        if self.max_bytes <= 0 or len(prompt) <= self.min_tokens:
            return None
        tokens = np.asarray(prompt, dtype=np.int32)
        best_key, best_len = -1, 0
        with self._lock:
            for key, entry in self._entries.items():
                length = _common_prefix(entry.tokens, tokens)
                if length > best_len:
                    best_key, best_len = key, length
            best_len = min(best_len, len(prompt) - 1)
            if best_len < self.min_tokens:
                return None
            self._entries.move_to_end(best_key)
            return PrefixMatch(self._entries[best_key], best_len)

    def store(self, tokens: list[int] | np.ndarray, caches: list[KVCache]) -> None:
        """Keep the keys/values of `tokens` (each cache holds exactly those, batch size 1)."""
        if self.max_bytes <= 0 or len(tokens) < self.min_tokens:
            return
        layers = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
        mx.eval(layers)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.max_bytes:
            return
        entry = CacheEntry(np.asarray(tokens, dtype=np.int32), layers, nbytes)
        with self._lock:
            for key, old in self._entries.items():
                if len(old.tokens) >= len(entry.tokens) and _common_prefix(
                    old.tokens, entry.tokens
                ) == len(entry.tokens):
                    self._entries.move_to_end(key)  # already covered by a longer entry
                    return
            # An entry that the new one extends is redundant.
            for key in [
                k
                for k, old in self._entries.items()
                if len(old.tokens) <= len(entry.tokens)
                and _common_prefix(old.tokens, entry.tokens) == len(old.tokens)
            ]:
                self._bytes -= self._entries.pop(key).nbytes
            self._entries[self._next_key] = entry
            self._next_key += 1
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
