"""ASGI plumbing shared by the API dialects: bodies, headers, whole responses, disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

from mlxgate._native import Dialect, Reader
from mlxgate.api.errors import ApiError
from mlxgate.api.reader import chunks

log = logging.getLogger("mlxgate")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# What the wrappers (api/middleware.py) and the handlers leave in a request's scope.
ROUTE = "mlxgate.route"  # the request's Route, None when no route has it
DIALECT = "mlxgate.dialect"  # the Dialect its errors are worded in
REQUEST_ID = "mlxgate.request_id"
BODY = "mlxgate.body"  # the whole request body, once read (POST)
# True once the SSE response's headers are out (errors after it are a stream's last frames).
EVENT_STREAM = "mlxgate.event_stream"
MODEL = "mlxgate.model"  # the name of the model answering it, once found
MODEL_WAIT = "mlxgate.model_wait"  # seconds it waited for its model to load (counted in TTFT)
READER = "mlxgate.reader"  # the reader of the generation answering it, once admitted

# The last message of a streamed response.
END = {"type": "http.response.body", "body": b"", "more_body": False}


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the {limit // (1024 * 1024)} MB limit")


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


def client_address(scope: Scope) -> str:
    """The address a request came from ("?" where the server does not say)."""
    return str((scope.get("client") or ("?",))[0])


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + (extra_headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError, dialect: Dialect) -> None:
    """`error` as a whole response in `dialect`'s envelope, with the headers clients act on."""
    await send_bytes(
        send, error.status(dialect), error.body(dialect), extra_headers=error.headers()
    )


async def refuse_websocket(scope: Scope, send: Send, error: ApiError, dialect: Dialect) -> None:
    """Refuse a websocket's handshake with `error` as an HTTP answer (ASGI's websocket denial
    response, which granian has), else by closing it before it is accepted (a plain 403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = error.body(dialect)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "websocket.http.response.start", "status": error.status(dialect)}
    await send({**start, "headers": headers + error.headers()})
    await send({"type": "websocket.http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_bytes(send, status, orjson.dumps(payload), extra_headers=extra_headers)


async def wait_disconnect(receive: Receive) -> None:
    # granian drops writes after a disconnect silently; only receive() reports it.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    receive: Receive, readers: Sequence[Reader], work: Awaitable[Any]
) -> Any:
    """Run `work`; if the client disconnects first, cancel the generations and return None."""
    return await unless_gone(wait_disconnect(receive), readers, work)


async def unless_gone(gone: Awaitable[Any], readers: Sequence[Reader], work: Awaitable[Any]) -> Any:
    """Run `work`; if `gone` (the client left) completes first, cancel the generations and
    return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(gone)
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            for reader in readers:
                reader.cancel()
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def start_event_stream(send: Send, scope: Scope | None = None) -> None:
    """The SSE response's headers; once per response with its `scope` (a stream that started
    while its model loaded is not started again)."""
    if scope is not None:
        if scope.get(EVENT_STREAM):
            return
        scope[EVENT_STREAM] = True
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            # Lowercase text/event-stream: granian flushes headers at once only for this type.
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                # nginx buffers a proxied response unless told not to.
                (b"x-accel-buffering", b"no"),
            ],
        }
    )


async def join(reader: Reader) -> bytes:
    return b"".join([data async for data in chunks(reader)])


async def collect(receive: Receive, reader: Reader) -> bytes | None:
    """The whole non-streamed body, or None if the client left first (generation cancelled)."""
    result: bytes | None = await unless_disconnected(receive, [reader], join(reader))
    return result
