"""The engine's ranks in lockstep: one model across processes (ranks.py), one schedule.

With a model sharded over ranks (tensor or pipeline parallel), every rank must make the same
model calls in the same order on caches of the same shape, or the collective ops inside the
layers stop lining up. Rank 0 runs the engine: admission, the router, sampling, the policy's
timings. The other ranks run the same engine code on their own shards, and everything that code
would learn from outside the model (a new request, a cancel, how many tokens a step may
prefill, the tokens sampled, which streams ended, an entry's size in the prefix cache) they are
told by rank 0 instead, at the point where rank 0 decides it: `Lockstep.share`. Given the same
decisions, the engine's bookkeeping (batch rows, prefix cache entries, prompt chunks) is the
same on every rank, so the plan of each step is the decisions alone.

A share is one `all_gather` of a small buffer through MLX's own distributed backend (a second
one for a payload past INLINE bytes): rank 0's part is the value, JSON. Rank 0's digest of its
state goes with each step's first share, and a follower that finds its own state different
stops the server rather than run the model on another schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import orjson

T = TypeVar("T")

# Bytes of a share's value sent in its first collective; a longer one takes a second.
INLINE = 1020


class RanksDiverged(RuntimeError):
    """A follower's engine state is not rank 0's: its next model call would not line up."""


class Lockstep:
    """A single process: every decision is its own."""

    leader = True
    rank = 0
    ranks = 1
    stopped = False  # the engine has stopped (and shares no more)

    def share(
        self,
        decide: Callable[[], T],
        encode: Callable[[T], Any] | None = None,
        decode: Callable[[Any], T] | None = None,
        *,
        evaluated: Any = None,
    ) -> T:
        """What `decide()` says on rank 0, on every rank (the others never call it). `encode`
        makes the value JSON, `decode` makes it back, where it is not JSON already.
        `evaluated`: arrays the others evaluate first (rank 0's `decide` does: a model call's
        collectives run on every rank before the value is shared)."""
        return decide()

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        return flag

    def failed(self, message: str) -> None:
        """This rank cannot go on: the group fails (ranks.py)."""


class RankGroup(Lockstep):
    """This process's rank of an `mx.distributed` group."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.ranks = group.size()
        self.leader = self.rank == 0
        self.shares = 0
        self.share_s = 0.0  # spent in shares (rank 0: the plan's broadcast overhead)
        # The watchdog's clock (ranks.py): when the other ranks last answered, and whether rank 0
        # is deciding (its own work, however long: nobody is waited for).
        self.alive_at = time.monotonic()
        self.deciding = False
        self.on_failure: Callable[[str], None] = lambda message: None

    def share(
        self,
        decide: Callable[[], T],
        encode: Callable[[T], Any] | None = None,
        decode: Callable[[Any], T] | None = None,
        *,
        evaluated: Any = None,
    ) -> T:
        if evaluated is not None:
            mx.eval(evaluated)  # the model's collectives: every rank has answered
            self.alive_at = time.monotonic()
        if self.leader:
            self.deciding = True
            try:
                value = decide()
            finally:
                self.deciding = False
                self.alive_at = time.monotonic()
            started = time.perf_counter()
            plan = encode(value) if encode else value
            self._broadcast(orjson.dumps(plan, option=orjson.OPT_SERIALIZE_NUMPY))
        else:
            started = time.perf_counter()
            raw = orjson.loads(self._broadcast(b""))
            value = decode(raw) if decode else raw
        self.share_s += time.perf_counter() - started
        self.shares += 1
        return value

    def any(self, flag: bool) -> bool:
        flags = mx.distributed.all_sum(mx.array([int(flag)]), group=self.group)
        mx.eval(flags)
        return bool(np.array(flags)[0] > 0)

    def failed(self, message: str) -> None:
        self.on_failure(message)

    def _broadcast(self, payload: bytes) -> bytes:
        """Rank 0's `payload` on every rank (the others pass b"")."""
        head = np.zeros(4 + INLINE, dtype=np.uint8)
        head[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), dtype=np.uint8)
        head[4 : 4 + min(len(payload), INLINE)] = np.frombuffer(payload[:INLINE], dtype=np.uint8)
        got = self._gather(head)
        size = int.from_bytes(got[:4].tobytes(), "little")
        if size <= INLINE:
            return got[4 : 4 + size].tobytes()
        # Every rank knows the size now: the rest in one more collective of that size.
        rest = np.zeros(size - INLINE, dtype=np.uint8)
        if self.leader:
            rest[:] = np.frombuffer(payload[INLINE:], dtype=np.uint8)
        return got[4:].tobytes() + self._gather(rest).tobytes()

    def _gather(self, part: np.ndarray) -> np.ndarray:
        """Rank 0's `part` (each rank passes one of the same size)."""
        gathered = mx.distributed.all_gather(mx.array(part), group=self.group)
        mx.eval(gathered)
        self.alive_at = time.monotonic()
        return np.array(gathered[: part.size], copy=True)
