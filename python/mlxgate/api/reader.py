"""The asyncio side of a native response reader: awaiting it (each wake takes every frame queued
since), and its frames as a stream sends them (a failure on the way as the dialect's error
event)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from mlxgate._native import Dialect, ErrorKind, Reader

log = logging.getLogger("mlxgate")

WakeAll = Callable[[list[asyncio.Future[None]]], object]


def _resolve_all(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class _ThisThreadsLoop(threading.local):
    # A thread runs one loop at a time; keeping only the latest lets old loops be collected.
    loop: asyncio.AbstractEventLoop | None = None
    wake_all: WakeAll | None = None


_this_threads_loop = _ThisThreadsLoop()


def wake_all_for(loop: asyncio.AbstractEventLoop) -> WakeAll:
    """The one `wake_all` every reader of `loop` parks with. The router groups parked readers by
    their wake_all's identity, so a step wakes all of a loop's readers with one
    `call_soon_threadsafe` (one write to the loop's self-pipe). Call it from the loop's thread."""
    cached = _this_threads_loop
    if cached.wake_all is None or cached.loop is not loop:  # a new loop (tests start many)

        def wake_all(futures: list[asyncio.Future[None]]) -> None:
            loop.call_soon_threadsafe(_resolve_all, futures)

        cached.loop = loop
        cached.wake_all = wake_all
    return cached.wake_all


async def chunks(reader: Reader) -> AsyncIterator[bytes]:
    """Yield everything the engine has queued for this response, coalesced, until it closes."""
    async for data, _ in events(reader):
        yield data


async def events(reader: Reader) -> AsyncIterator[tuple[bytes, int]]:
    """As `chunks`, each with the id of its last event (a streamed response's events are
    numbered as they are queued)."""
    loop = asyncio.get_running_loop()
    wake_all = wake_all_for(loop)
    while True:
        taken = reader.take_events()
        if taken is None:
            return
        if taken[0]:
            yield taken
            continue
        future: asyncio.Future[None] = loop.create_future()
        if reader.park(future, wake_all):
            await future


async def frames(reader: Reader, dialect: Dialect) -> AsyncIterator[tuple[bytes, int]]:
    """The response's frames as the engine queues them, each chunk with its last event's id. A
    failure on the way ends them with the dialect's error event: the status line is out."""
    last_id = 0
    try:
        async for data, last_id in events(reader):
            yield data, last_id
    except Exception:
        log.exception("stream %d failed after its headers were sent", reader.stream_id)
        reader.cancel()
        message = "the stream failed inside the server (the server log has details)"
        yield dialect.error_events(ErrorKind.INTERNAL, message, last_id + 1)
