"""Awaiting a native stream reader from asyncio: each wake takes every frame queued since."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from mlxgate._native import Reader


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def chunks(reader: Reader) -> AsyncIterator[bytes]:
    """Yield everything the engine has queued for this stream, coalesced, until it closes."""
    loop = asyncio.get_running_loop()
    while True:
        data = reader.take()
        if data is None:
            return
        if data:
            yield data
            continue
        future: asyncio.Future[None] = loop.create_future()
        if reader.park(functools.partial(loop.call_soon_threadsafe, _resolve, future)):
            await future
