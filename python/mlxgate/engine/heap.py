"""Giving the C heap's free pages back to the system.

MLX's CPU arrays live in malloc's heap. glibc keeps what is freed there for reuse and returns
memory only from the top of a heap, so the prefix cache's churn (entries made and evicted all
the time, beside the KV caches of running rows) leaves free pages inside the heap that count in
the process's RSS: 1.2 GB more than MLX's live arrays after 30 minutes of mixed load
(benches/results/soak-20261124-114727.md). `malloc_trim(0)` hands those pages back
(madvise(MADV_DONTNEED)) without moving anything. Setting `MALLOC_MMAP_THRESHOLD_` instead
costs 3-4% of throughput (every large buffer its own mapping, zeroed on each allocation).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from collections.abc import Callable

from mlxgate.engine.metrics import EngineMetrics

# Seconds between trims while the engine works; once more each time it goes idle.
TRIM_INTERVAL_S = 10.0


def trimmer() -> Callable[[], object] | None:
    """`malloc_trim(0)` where the C library has it (glibc), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # musl, or no shared C library
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return functools.partial(malloc_trim, 0)


class Tidier:
    """After each engine step that worked: the heap's free pages back every TRIM_INTERVAL_S of
    work, and once more on going idle."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.trim = trimmer()
        self.trimmed_at = 0.0

    def worked(self, busy: bool) -> None:
        """A step worked; `busy`: whether more work waits."""
        now = time.monotonic()
        if self.trim is None or (busy and now - self.trimmed_at < TRIM_INTERVAL_S):
            return
        self.trim()
        self.trimmed_at = time.monotonic()
        with self.metrics.lock:
            self.metrics.heap_trims += 1
            self.metrics.heap_trim_s += self.trimmed_at - now
