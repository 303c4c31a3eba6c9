"""The Responses API over a WebSocket (`/v1/responses` upgraded: Codex with
`supports_websockets`): each `response.create` message is answered, in turn, with the events its
HTTP stream would carry, one JSON text message each. The connection keeps its last response's
conversation, so a follow-up (`previous_response_id`) sends only its new items, `store: false`
or not; `generate: false` answers at once without running the model (a client's prewarm). A
client that closes mid-response cancels it."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from mlxgate import logs
from mlxgate._native import Dialect, ErrorKind, Reader, event_data, websocket_error
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError, api_error, invalid
from mlxgate.api.guard import Guard
from mlxgate.api.http import Receive, Scope, Send, refuse_websocket, unless_gone
from mlxgate.api.middleware import shutting_down, unauthorized
from mlxgate.api.reader import events
from mlxgate.api.requests import json_object, validate
from mlxgate.api.responses.requests import Item, ResponsesRequest
from mlxgate.api.responses.routes import ResponsesAPI
from mlxgate.registry import ModelError

log = logging.getLogger("mlxgate")

RESPONSES = Dialect.RESPONSES
ROUTE = "/v1/responses"
# A client sends the next response.create once the last one is answered; one that queues more
# than this many is closed (1008) rather than held in memory.
MAX_WAITING = 8


class ResponsesWebSocket:
    """The app websockets go to: checks the handshake as the HTTP wrappers check a request (the
    route, the host guard and browser origins, the API key, the drain), then serves the
    connection."""

    def __init__(
        self,
        api: ResponsesAPI,
        guard: Guard,
        drain: Drain,
        registry: CollectorRegistry,
        *,
        max_message_bytes: int,
    ) -> None:
        self.api = api
        self.guard = guard
        self.drain = drain
        self.max_message_bytes = max_message_bytes
        self.connections = Counter(
            "mlxgate_websocket_connections_total",
            "WebSocket handshakes by route and status (101: accepted)",
            ["route", "status"],
            registry=registry,
        )
        self.responses = Counter(
            "mlxgate_websocket_responses_total",
            "response.create messages answered over WebSockets, by route and the status the HTTP "
            "request would have had",
            ["route", "status"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        path = scope["path"].rstrip("/")
        routed = path.endswith(ROUTE.removeprefix("/v1"))
        try:
            if not routed:
                raise ApiError(
                    ErrorKind.NOT_FOUND, f"websocket {path} is not a route of this server"
                )
            self.guard.check(scope)
            if not self.guard.authorized(scope):
                raise unauthorized()
            if self.drain.draining:
                raise shutting_down(self.drain)
        except ApiError as exc:
            status = exc.status(RESPONSES)
            self.connections.labels(ROUTE if routed else "other", str(status)).inc()
            log.info("websocket %s refused: %d %s", path, status, exc.message)
            await refuse_websocket(scope, send, exc, RESPONSES)
            return
        await send({"type": "websocket.accept"})
        self.connections.labels(ROUTE, "101").inc()
        await Connection(self, scope, receive, send).serve()


@dataclass(frozen=True)
class Answered:
    """A response the connection answered: what a follow-up's `previous_response_id` names, and
    the conversation it continues (every input item up to it, then its output)."""

    response_id: str
    conversation: list[Item]


class Connection:
    """One accepted socket: its messages answered one after another."""

    def __init__(
        self, server: ResponsesWebSocket, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.server = server
        self.api = server.api
        self.receive = receive
        self.send = send
        self.client = server.guard.client(scope)
        # Messages not yet answered; None once the client has gone.
        self.waiting: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.gone = asyncio.Event()
        self.overrun = False
        self.last: Answered | None = None
        self.model = server.api.services.models.default.name  # the last message's, for the log

    async def serve(self) -> None:
        listening = asyncio.ensure_future(self.listen())
        try:
            while (message := await self.waiting.get()) is not None and not self.gone.is_set():
                await self.answer(message)
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        if self.overrun:
            reason = f"more than {MAX_WAITING} response.create messages waiting"
            await self.send({"type": "websocket.close", "code": 1008, "reason": reason})

    async def listen(self) -> None:
        """Queue the client's messages until it closes; a close also cancels the response being
        generated (`gone`)."""
        try:
            while True:
                message = await self.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message["type"] != "websocket.receive":
                    continue
                if self.waiting.qsize() >= MAX_WAITING:
                    self.overrun = True
                    return
                text = message.get("text")
                self.waiting.put_nowait(text if text is not None else message.get("bytes") or b"")
        finally:
            self.gone.set()
            self.waiting.put_nowait(None)

    async def answer(self, message: str | bytes) -> None:
        """Answer one message: its response's events, or an error message (the socket stays
        open); one request log line and one count each."""
        started = time.monotonic()
        reader: Reader | None = None
        try:
            reader = await self.create(message)
            status = reader.status if reader is not None else 200
        except (ApiError, ModelError) as caught:
            exc = api_error(caught)
            status = exc.status(RESPONSES)
            await self.send_error(exc)
        except Exception:
            log.exception("unhandled error answering a websocket message on %s", ROUTE)
            error = ApiError(
                ErrorKind.INTERNAL, "internal server error (the server log has the details)"
            )
            status = error.status(RESPONSES)
            await self.send_error(error)
        self.server.responses.labels(ROUTE, str(status)).inc()
        fields: dict[str, Any] = {
            "id": f"req_{secrets.token_hex(12)}",
            "method": "WS",
            "route": ROUTE,
            "dialect": "responses",
            "model": self.model,
            "status": status,
            "duration_s": round(time.monotonic() - started, 4),
        }
        logs.request_ended(fields, [reader] if reader is not None else [])

    async def create(self, message: str | bytes) -> Reader | None:
        """Answer a `response.create`: returns its generation's reader, None for one that
        generates nothing (`generate: false`)."""
        request, generate = self.parse(message)
        guard = self.server.guard
        guard.take_token(self.client)
        history = self.history(request.previous_response_id)
        prepared = self.api.prepare(request, history)
        served = await self.api.pipeline.loaded(request)
        self.model = served.name
        if not generate:
            frames, response = prepared.spec(None, served.name).empty_response()
            await self.send_events(frames)
            self.remember(request, history, prepared.response_id, response)
            return None
        drain = self.server.drain
        if drain.draining:
            raise shutting_down(drain)
        with guard.slot(self.client), drain.running():
            reader = await self.api.pipeline.admit(
                served, request, prepared.conversation, prepared.spec
            )
            await unless_gone(self.gone.wait(), [reader], self.relay(reader))
        self.remember(request, history, prepared.response_id, reader.result)
        return reader

    def parse(self, message: str | bytes) -> tuple[ResponsesRequest, bool]:
        """The request a message carries, streamed whatever it says, and whether to generate."""
        if isinstance(message, bytes):
            raise invalid("send response.create as a text message, not a binary one")
        limit = self.server.max_message_bytes
        if len(message.encode()) > limit:
            raise ApiError(
                ErrorKind.REQUEST_TOO_LARGE,
                f"message is larger than the {limit // (1024 * 1024)} MB limit",
            )
        payload = json_object(message, "message")
        if (kind := payload.pop("type", None)) != "response.create":
            raise invalid(f"type: expected 'response.create', got {kind!r}", param="type")
        generate = payload.pop("generate", True)
        if not isinstance(generate, bool):
            raise invalid("generate: must be true or false", param="generate")
        return validate(ResponsesRequest, {**payload, "stream": True}), generate

    def history(self, previous_id: str | None) -> list[Item]:
        """What `previous_response_id` continues: this connection's last response, else a stored
        one."""
        if self.last is not None and previous_id == self.last.response_id:
            return self.last.conversation
        return self.api.history(previous_id)

    def remember(
        self,
        request: ResponsesRequest,
        history: list[Item],
        response_id: str,
        response: bytes | None,
    ) -> None:
        """Keep the response for a follow-up on this connection (and in the store, if asked)."""
        if response is None:
            return
        self.api.keep(request, response_id, response)
        output = orjson.loads(response).get("output") or []
        conversation = [*history, *request.items, *(Item.model_validate(i) for i in output)]
        self.last = Answered(response_id, conversation)

    async def relay(self, reader: Reader) -> None:
        """The response's events as the engine queues them, one message each. A failure on the
        way ends them with an error message."""
        try:
            async for frames, _ in events(reader):
                await self.send_events(frames)
        except Exception:
            log.exception("websocket stream %d failed", reader.stream_id)
            reader.cancel()
            message = "the stream failed inside the server (the server log has details)"
            await self.send_error(ApiError(ErrorKind.INTERNAL, message))

    async def send_events(self, frames: bytes) -> None:
        for text in event_data(frames):
            await self.send({"type": "websocket.send", "text": text})

    async def send_error(self, error: ApiError) -> None:
        text = websocket_error(error.kind, error.message, param=error.param, code=error.code)
        await self.send({"type": "websocket.send", "text": text})
