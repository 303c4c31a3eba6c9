"""The ASGI wrappers the app is composed of: each does one job around the app it wraps.

The app (app.py) stacks them, outermost first: lifespan, websockets (to their own app,
api/responses/websocket.py), routing, CORS headers, request id, request log, counters, error
envelopes, host guard, preflight, auth, not found; then, for the requests that generate (POST),
drain, rate limit, body limit, trace and slots; then the route's handler. What one finds for
the next is in the scope: `mlxgate.route`, `mlxgate.dialect`, `mlxgate.request_id`,
`mlxgate.body`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from mlxgate import logs, trace
from mlxgate._native import Dialect, ErrorKind
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError, api_error
from mlxgate.api.guard import Guard
from mlxgate.api.http import (
    BODY,
    DIALECT,
    END,
    EVENT_STREAM,
    MODEL,
    MODEL_WAIT,
    READER,
    REQUEST_ID,
    ROUTE,
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    client_address,
    header,
    read_body,
    send_error,
)
from mlxgate.api.routing import Route
from mlxgate.registry import ModelError

log = logging.getLogger("mlxgate")

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def on_start(send: Send, hook: Callable[[Message], None]) -> Send:
    """`send`, showing `hook` the response's start message first (to read or add to)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            hook(message)
        await send(message)

    return sending


def add_headers(message: Message, headers: Sequence[tuple[bytes, bytes]]) -> None:
    message["headers"] = [*message.get("headers", []), *headers]


def fallback_dialect(path: str) -> Dialect:
    """The envelope for a path no route has: OpenAI's where the path looks like OpenAI's."""
    openai = any(word in path for word in ("completions", "embeddings", "/v1/models", "responses"))
    return Dialect.OPENAI if openai else Dialect.ANTHROPIC


def route_label(scope: Scope) -> str:
    """The route as metrics name it: a prefix route's path would be one label per id."""
    route: Route | None = scope.get(ROUTE)
    return route.path if route and not route.prefix else "other"


def generates(scope: Scope) -> bool:
    """Whether the request may run a generation (counting tokens generates nothing)."""
    return not route_label(scope).endswith("count_tokens")


class Lifespan:
    """Answers the lifespan protocol (`startup` and `shutdown` run at the server's start and
    stop) and hands HTTP requests and websockets to `app`."""

    def __init__(
        self, app: ASGIApp, startup: Callable[[], None], shutdown: Callable[[], None]
    ) -> None:
        self.app = app
        self.startup = startup
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            await self.app(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.startup()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return


class WebSockets:
    """Hands websockets to `websocket` (which checks their handshake itself), HTTP requests to
    `app`."""

    def __init__(self, app: ASGIApp, websocket: ASGIApp) -> None:
        self.app = app
        self.websocket = websocket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await (self.websocket if scope["type"] == "websocket" else self.app)(scope, receive, send)


class Routing:
    """Finds the request's route by path suffix and method (and header, for a route only one
    dialect answers), and the dialect its errors are worded in."""

    def __init__(self, app: ASGIApp, routes: Sequence[Route]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"].rstrip("/") or "/"
        route = self.find(scope, scope["method"], path)
        scope[ROUTE] = route
        scope[DIALECT] = route.dialect if route else fallback_dialect(path)
        await self.app(scope, receive, send)

    def find(self, scope: Scope, method: str, path: str) -> Route | None:
        for route in self.routes:
            if route.method != method or (route.header and header(scope, route.header) is None):
                continue
            if route.matches(path):
                return route
        return None


class Cors:
    """Adds the CORS headers to every answer to an allowed browser origin."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = self.guard.cors_headers(scope)
        await self.app(scope, receive, on_start(send, lambda m: add_headers(m, headers)))


class RequestId:
    """Names each request (`req_` and 24 hex digits): in the scope, and in the answer's
    `request-id` and `x-request-id` headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = f"req_{secrets.token_hex(12)}"
        scope[REQUEST_ID] = request_id
        headers = [(b"request-id", request_id.encode()), (b"x-request-id", request_id.encode())]
        await self.app(scope, receive, on_start(send, lambda m: add_headers(m, headers)))


class RequestLog:
    """Leaves one log line per request when it ends (logs.request_ended), with what its response
    came to (the reader the handler left in the scope)."""

    def __init__(self, app: ASGIApp, model: str) -> None:
        self.app = app
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 0
        started = time.monotonic()

        def seen(message: Message) -> None:
            nonlocal status
            status = message["status"]

        try:
            await self.app(scope, receive, on_start(send, seen))
        finally:
            route: Route | None = scope.get(ROUTE)
            fields = {
                "id": scope.get(REQUEST_ID),
                "method": scope["method"],
                "route": route.path if route else scope["path"].rstrip("/") or "/",
                "dialect": repr(scope[DIALECT]).removeprefix("Dialect.").lower(),
                "model": scope.get(MODEL, self.model),
                "status": status,
                "duration_s": round(time.monotonic() - started, 4),
            }
            if (waited := scope.get(MODEL_WAIT)) is not None:
                fields["model_wait_s"] = round(waited, 4)
            reader = scope.get(READER)
            logs.request_ended(fields, [reader] if reader is not None else [])


class Counters:
    """Counts requests by route and status (499: the client left before any answer)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "mlxgate_http_requests_total",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 0

        def seen(message: Message) -> None:
            nonlocal status
            status = message["status"]

        try:
            await self.app(scope, receive, on_start(send, seen))
        finally:
            self.requests.labels(route_label(scope), str(status or 499)).inc()


class Envelopes:
    """Answers what the wrapped app raises in the route's dialect: its ApiErrors, a body over
    the limit (413) and any other failure (500, logged) when no answer has started; a client
    that left gets nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        def seen(message: Message) -> None:
            nonlocal started
            started = True

        send = on_start(send, seen)
        dialect: Dialect = scope[DIALECT]
        try:
            await self.app(scope, receive, send)
        except (ApiError, ModelError) as caught:
            exc = api_error(caught)
            if scope.get(EVENT_STREAM):  # (a stream that started while its model loaded)
                body = exc.body(dialect, stream=True)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                await send(END)
                return
            await send_error(send, exc, dialect)
        except BodyTooLarge as exc:
            await send_error(send, ApiError(ErrorKind.REQUEST_TOO_LARGE, str(exc)), dialect)
        except ClientGone:
            pass
        except Exception:
            path = scope["path"].rstrip("/") or "/"
            log.exception("unhandled error on %s %s", scope["method"], path)
            if not started:
                error = ApiError(
                    ErrorKind.INTERNAL, "internal server error (the server log has the details)"
                )
                await send_error(send, error, dialect)


class HostGuard:
    """Refuses (403) a Host no loopback or allowed name (DNS rebinding) and a browser origin not
    allowed (Guard.check)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.guard.check(scope)
        await self.app(scope, receive, send)


class Preflight:
    """Answers a browser's preflight (OPTIONS with an Origin; HostGuard refused the others)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "OPTIONS" or header(scope, b"origin") is None:
            await self.app(scope, receive, send)
            return
        headers = self.guard.preflight_headers(scope)
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


class Auth:
    """Refuses (401) a request without the API key, when one is set (`/health` never needs
    it)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"].rstrip("/")
        if not path.endswith("/health") and not self.guard.authorized(scope):
            raise unauthorized()
        await self.app(scope, receive, send)


def unauthorized() -> ApiError:
    return ApiError(
        ErrorKind.AUTHENTICATION,
        "invalid x-api-key or Authorization bearer token",
        should_retry=False,
        code="invalid_api_key",
    )


class NotFound:
    """Refuses (404) a request no route has."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get(ROUTE) is None:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"{scope['method']} {scope['path']} is not a route of this server",
            )
        await self.app(scope, receive, send)


class Posts:
    """Runs POST requests (the ones that generate) through `wrap(app)`, the others to `app`."""

    def __init__(self, app: ASGIApp, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        self.app = app
        self.posts = wrap(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await (self.posts if scope["method"] == "POST" else self.app)(scope, receive, send)


class DrainGate:
    """Refuses (503, with retry-after) new requests while the server drains, and counts the
    others in the drain while they run."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.drain.draining:
            raise shutting_down(self.drain)
        with self.drain.running():
            await self.app(scope, receive, send)


def shutting_down(drain: Drain) -> ApiError:
    return ApiError(
        ErrorKind.UNAVAILABLE, "the server is shutting down", retry_after_s=int(drain.timeout_s) + 1
    )


class RateLimit:
    """Refuses (429) a client past its requests a minute (Guard.take_token)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.guard.take_token(self.guard.client(scope))
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body into the scope, refusing one over `limit` bytes (BodyTooLarge)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[BODY] = await read_body(receive, self.limit)
        await self.app(scope, receive, send)


class Trace:
    """Records each generation request in the trace file (`--record-trace`), as it arrives."""

    def __init__(self, app: ASGIApp, recorder: trace.Recorder) -> None:
        self.app = app
        self.recorder = recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route: Route | None = scope.get(ROUTE)
        if route is None or not generates(scope):
            await self.app(scope, receive, send)
            return
        session = trace.session_of(scope["headers"], client_address(scope))
        self.recorder.started(session, route.path, scope.get(BODY, b""))
        try:
            await self.app(scope, receive, send)
        finally:
            self.recorder.ended(session)


class Slots:
    """Holds one of the client's generation requests in flight while it runs (429 past
    `--max-per-client`, Guard.slot)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        slot = self.guard.slot(self.guard.client(scope)) if generates(scope) else None
        with slot or contextlib.nullcontext():
            await self.app(scope, receive, send)


async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
    """The route's handler, with the body read (empty for a request without one)."""
    route: Route = scope[ROUTE]
    await route.handler(scope, receive, send, scope.get(BODY, b""))
