"""Cache reuse across requests: the longest cached token prefix, bounded by bytes, LRU eviction.

An entry holds a copy of every layer's cache after a run of tokens. Attention keys/values can
be cut at any token, so an entry serves any prompt that shares part of its tokens. A sliding
window or a recurrent state holds exactly what it has seen: for a model with such layers an
entry is a snapshot, reused only by a prompt that starts with all of its tokens, and shorter
snapshots are kept beside longer ones (an agent's next turn branches off where its last prompt
ended, another session's off the end of the shared system prompt).

With a disk tier (engine/disk_cache.py) every stored entry is also written to disk, and a lookup
takes the longer of the two tiers' matches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from mlxgate.engine import cache_kinds


@dataclass(frozen=True)
class CacheEntry:
    tokens: np.ndarray  # the token ids whose state `layers` hold, in order
    layers: list[Any]  # per layer, a single-sequence cache no one writes to
    nbytes: int
    variant: int = 0  # how the model computed them (its own rope or the scaled one)


class PrefixMatch(Protocol):
    """A cached prefix of a prompt: `length` tokens (settled by `caches()`, which may find fewer
    on disk than the index promised)."""

    @property
    def length(self) -> int: ...

    @property
    def tier(self) -> str:
        """Where it comes from: "memory" or "disk"."""
        ...

    def caches(self) -> list[Any]: ...


class DiskTier(Protocol):
    """What the prefix cache asks of its disk tier (engine/disk_cache.py's `DiskCache`)."""

    def lookup(
        self,
        tokens: np.ndarray,
        variant: int,
        limit: int,
        fallback: PrefixMatch | None,
        longer_than: int = 0,
    ) -> PrefixMatch | None:
        """The longest prefix of `tokens` on disk, if longer than `fallback` (memory's match)
        and `longer_than`."""
        ...

    def write(self, entry: CacheEntry) -> None: ...

    def close(self, timeout_s: float = 30.0) -> None: ...


@dataclass(frozen=True)
class MemoryMatch:
    entry: CacheEntry
    length: int  # tokens of the entry reused as the request's prefix
    tier = "memory"

    def caches(self) -> list[Any]:
        """Fresh per-layer caches holding the first `length` tokens (engine thread only)."""
        if self.length == len(self.entry.tokens):
            return [cache_kinds.snapshot(layer) for layer in self.entry.layers]
        return [cache_kinds.cut(layer, self.length) for layer in self.entry.layers]


def entry_bytes(layers: list[Any]) -> int:
    """What an entry's layers hold, in bytes."""
    return sum(cache_kinds.nbytes(layer) for layer in layers)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class PrefixCache:
    """Entries are immutable once stored, so a match stays valid after its entry is evicted.

    `lookup` runs on the event loop (the reused count goes into message_start) and `store` on the
    engine thread; a lock guards the index, never MLX work.
    """

    def __init__(
        self,
        max_bytes: int,
        min_tokens: int = 16,
        *,
        cuttable: bool = True,
        disk: DiskTier | None = None,
        measure: Callable[[list[Any]], int] | None = None,
    ) -> None:
        """`measure`: an entry's bytes (its layers' arrays, unless given)."""
        self.max_bytes = max_bytes
        self._measure = measure or entry_bytes
        self.min_tokens = min_tokens
        self.cuttable = cuttable  # entries can be reused in part (attention keys/values only)
        self.disk = disk
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next_key = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stores(self) -> int:
        """Entries stored since the start: a lookup made before the last store may find more
        now."""
        return self._next_key

    def lookup(
        self, prompt: list[int], variant: int = 0, longer_than: int = 0
    ) -> PrefixMatch | None:
        """The longest cached prefix of `prompt` computed as `variant`, in memory or on disk,
        leaving at least one token to compute; None unless longer than `longer_than` (a match
        the caller holds: a disk match starts reading its files)."""
        if self.max_bytes <= 0 or len(prompt) <= self.min_tokens:
            return None
        tokens = np.asarray(prompt, dtype=np.int32)
        limit = len(prompt) - 1
        best_key, best_len = -1, 0
        with self._lock:
            for key, entry in self._entries.items():
                if entry.variant != variant:
                    continue
                length = min(common_prefix(entry.tokens, tokens), limit)
                if not self.cuttable and length < len(entry.tokens):
                    continue  # a snapshot is all or nothing
                if length > best_len:
                    best_key, best_len = key, length
            match = None
            if best_len >= max(self.min_tokens, longer_than + 1):
                self._entries.move_to_end(best_key)
                match = MemoryMatch(self._entries[best_key], best_len)
        if self.disk is not None:
            on_disk = self.disk.lookup(tokens, variant, limit, match, longer_than)
            if on_disk is not None and on_disk.length >= self.min_tokens:
                return on_disk
        return match

    def _covered(self, tokens: np.ndarray, variant: int) -> bool:
        """Whether an entry holds these tokens already (a longer one, where entries can be cut);
        it then counts as used."""
        with self._lock:
            for key, old in self._entries.items():
                if old.variant != variant:
                    continue
                if common_prefix(old.tokens, tokens) == len(tokens) and (
                    len(old.tokens) == len(tokens) or self.cuttable
                ):
                    self._entries.move_to_end(key)
                    return True
        return False

    def store(self, tokens: list[int] | np.ndarray, caches: list[Any], variant: int = 0) -> None:
        """Keep a copy of the state of `tokens` (each cache holds exactly those, one sequence),
        computed as `variant`."""
        if self.max_bytes <= 0 or len(tokens) < self.min_tokens:
            return
        token_ids = np.asarray(tokens, dtype=np.int32)
        if self._covered(token_ids, variant):
            return
        layers = [cache_kinds.snapshot(cache, owned=True) for cache in caches]
        mx.eval([cache_kinds.arrays(layer) for layer in layers])
        nbytes = self._measure(layers)
        if nbytes > self.max_bytes:
            return
        entry = CacheEntry(token_ids, layers, nbytes, variant)
        with self._lock:
            if self.cuttable:
                # An entry that the new one extends is redundant.
                for key in [
                    k
                    for k, old in self._entries.items()
                    if old.variant == variant
                    and common_prefix(old.tokens, entry.tokens) == len(old.tokens)
                ]:
                    self._bytes -= self._entries.pop(key).nbytes
            self._entries[self._next_key] = entry
            self._next_key += 1
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
        if self.disk is not None:
            self.disk.write(entry)

    def close(self) -> None:
        """Finish writing to disk (after the engine's last step)."""
        if self.disk is not None:
            self.disk.close()
