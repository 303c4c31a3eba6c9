"""OpenAI's `n` > 1: one engine stream per choice (the engine prefills their prompt once), merged
into one response. Streamed, the choices' chunks go out interleaved as they come, each with its
own `index`, then one usage chunk (if asked for) and one `[DONE]`; not streamed, one body with
every choice. Usage counts the prompt once and the completion tokens of every choice."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from mlxgate._native import Reader
from mlxgate.api.event_streams import Produce, Resumable, Write, stream_events
from mlxgate.api.http import Receive, Scope, Send, join, send_bytes, unless_disconnected
from mlxgate.streams import chunks

DONE = b"data: [DONE]\n\n"


async def respond_choices(
    scope: Scope,
    send: Send,
    receive: Receive,
    readers: list[Reader],
    *,
    stream: bool,
    resumable: Resumable | None,
) -> None:
    if stream:
        produce = _merged(readers)
        await stream_events(scope, send, receive, readers, produce, resumable)
        return
    bodies = await unless_disconnected(receive, readers, asyncio.gather(*map(join, readers)))
    if bodies is None:
        return
    failed = next((i for i, reader in enumerate(readers) if reader.status != 200), None)
    if failed is not None:
        await send_bytes(send, readers[failed].status, bodies[failed])
        return
    merged: dict[str, Any] = orjson.loads(bodies[0])
    others = [orjson.loads(body) for body in bodies[1:]]
    merged["choices"] += [body["choices"][0] for body in others]
    _add_usage(merged["usage"], [body["usage"] for body in others])
    await send_bytes(send, 200, orjson.dumps(merged))


def _merged(readers: list[Reader]) -> Produce:
    async def produce(write: Write) -> None:
        arrived: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(reader: Reader) -> None:
            try:
                async for data in chunks(reader):
                    await arrived.put(data)
            finally:
                await arrived.put(None)

        pumps = [asyncio.ensure_future(pump(reader)) for reader in readers]
        usage: dict[str, Any] | None = None
        open_choices = len(readers)
        try:
            while open_choices:
                data = await arrived.get()
                if data is None:
                    open_choices -= 1
                    continue
                if data.endswith(DONE):  # a choice's last frames: its usage chunk, if any, [DONE]
                    data, usage = _without_ending(data, usage)
                if data:
                    await write(data)
        finally:
            for task in pumps:
                task.cancel()
        tail = b"data: " + orjson.dumps(usage) + b"\n\n" if usage is not None else b""
        await write(tail + DONE)

    return produce


def _without_ending(
    data: bytes, usage: dict[str, Any] | None
) -> tuple[bytes, dict[str, Any] | None]:
    """A choice's last frames without its `[DONE]` and usage chunk; the usage so far with its."""
    frames = []
    for frame in data.split(b"\n\n"):
        if not frame or frame + b"\n\n" == DONE:
            continue
        if frame.startswith(b"data: {") and b'"choices":[]' in frame:
            chunk = orjson.loads(frame[len(b"data: ") :])
            if usage is None:
                usage = chunk
            else:
                _add_usage(usage["usage"], [chunk["usage"]])
            continue
        frames.append(frame + b"\n\n")
    return b"".join(frames), usage


def _add_usage(total: dict[str, Any], others: list[dict[str, Any]]) -> None:
    """The prompt counted once, every choice's completion tokens."""
    total["completion_tokens"] += sum(u["completion_tokens"] for u in others)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
