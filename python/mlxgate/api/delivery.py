"""Answering with a generation: the whole body with the status its end implies, or its SSE
events as the engine queues them (numbered already). A client that leaves cancels the
generation, or, with `--resume-window`, leaves it to the window (api/resumable.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlxgate._native import Dialect, Reader
from mlxgate.api.http import (
    END,
    Receive,
    Scope,
    Send,
    collect,
    send_bytes,
    start_event_stream,
    unless_disconnected,
)
from mlxgate.api.reader import frames

if TYPE_CHECKING:
    from mlxgate.api.resumable import Resumable

log = logging.getLogger("mlxgate")


async def respond(
    scope: Scope,
    send: Send,
    receive: Receive,
    reader: Reader,
    dialect: Dialect,
    *,
    stream: bool,
    resumable: Resumable | None,
) -> None:
    """Answer with the generation: SSE as it happens, or the whole body with the status its end
    implies (an error's, if the generation failed)."""
    if not stream:
        body = await collect(receive, reader)
        if body is not None:
            await send_bytes(send, reader.status, body)
        return
    if resumable is not None:
        await resumable.stream(scope, send, receive, reader, dialect)
        return
    await start_event_stream(send, scope)

    async def relay() -> None:
        async for data, _ in frames(reader, dialect):
            await send({"type": "http.response.body", "body": data, "more_body": True})

    await unless_disconnected(receive, [reader], relay())
    await send(END)
