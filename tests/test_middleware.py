"""Each ASGI wrapper of api/middleware.py alone, around a fake app, with fake receive and send."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from mlxgate import trace
from mlxgate._native import Dialect, ErrorKind, Reply, Router, StreamSpec, Vocab
from mlxgate.api import middleware as mw
from mlxgate.api.drain import Drain
from mlxgate.api.errors import ApiError
from mlxgate.api.guard import Guard
from mlxgate.api.http import BodyTooLarge, ClientGone, Message, Receive, Scope, Send
from mlxgate.api.routing import Route


def run(coroutine: Awaitable[Any]) -> Any:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


def scope(
    method: str = "POST",
    path: str = "/v1/messages",
    headers: dict[str, str] | None = None,
    route: Route | None = None,
    dialect: Dialect = Dialect.ANTHROPIC,
) -> Scope:
    encoded = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": encoded,
        "client": ("10.0.0.7", 5000),
        mw.ROUTE: route,
        mw.DIALECT: dialect,
    }


async def _handler(scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
    await ok(scope, receive, send)


MESSAGES = Route("POST", "/v1/messages", Dialect.ANTHROPIC, _handler)
COUNT = Route("POST", "/v1/messages/count_tokens", Dialect.ANTHROPIC, _handler)
MODEL = Route("GET", "/v1/models/", Dialect.OPENAI, _handler, prefix=True)


class Sent:
    """A fake `send`: what went out."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def headers(self) -> dict[bytes, bytes]:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"]) if starts else {}

    @property
    def json(self) -> Any:
        return orjson.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))


def receiving(*messages: Message) -> Receive:
    """A fake `receive`: these messages, then a disconnect forever."""
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    return receive


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


class Inner:
    """A fake inner app: answers 200 (or runs `then`), keeping the scope it saw."""

    def __init__(self, then: Callable[[Scope, Receive, Send], Awaitable[None]] = ok) -> None:
        self.then = then
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(dict(scope))
        await self.then(scope, receive, send)


def raising(exc: BaseException) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise exc

    return app


def call(app: mw.ASGIApp, request: Scope, receive: Receive | None = None) -> Sent:
    sent = Sent()
    run(app(request, receive or receiving(), sent))
    return sent


def refusal(app: mw.ASGIApp, request: Scope) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call(app, request)
    return raised.value


# Lifespan, routing, headers -------------------------------------------------------------------


def test_lifespan_runs_startup_and_shutdown_and_passes_http_and_websockets_on() -> None:
    calls: list[str] = []
    inner = Inner()
    app = mw.Lifespan(inner, lambda: calls.append("up"), lambda: calls.append("down"))
    sent = Sent()
    run(
        app(
            {"type": "lifespan"},
            receiving({"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}),
            sent,
        )
    )
    assert calls == ["up", "down"]
    assert [m["type"] for m in sent.messages] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    assert call(app, scope()).status == 200
    call(app, {"type": "websocket"})
    assert call(app, {"type": "something-else"}).messages == []
    assert [s["type"] for s in inner.scopes] == ["http", "websocket"]


def test_websockets_go_to_their_own_app() -> None:
    http, websocket = Inner(), Inner()
    app = mw.WebSockets(http, websocket)
    call(app, scope())
    call(app, {"type": "websocket", "path": "/v1/responses"})
    assert [s["type"] for s in http.scopes] == ["http"]
    assert [s["type"] for s in websocket.scopes] == ["websocket"]


def test_routing_finds_the_route_by_suffix_method_and_header() -> None:
    anthropic_models = Route("GET", "/v1/models", Dialect.ANTHROPIC, _handler, header=b"x-a")
    routes = [MESSAGES, anthropic_models, MODEL]
    inner = Inner()
    app = mw.Routing(inner, routes)
    for path in ("/v1/messages", "/messages/", "/some/prefix/v1/messages"):
        call(app, scope(path=path, route=None))
        assert inner.scopes[-1][mw.ROUTE] is MESSAGES
    call(app, scope("GET", "/v1/models/org/name", route=None))
    assert inner.scopes[-1][mw.ROUTE] is MODEL
    call(app, scope("GET", "/v1/models", {"x-a": "1"}, route=None))
    assert inner.scopes[-1][mw.ROUTE] is anthropic_models
    call(app, scope("GET", "/v1/messages", route=None))  # the method differs
    assert inner.scopes[-1][mw.ROUTE] is None
    assert inner.scopes[-1][mw.DIALECT] == Dialect.ANTHROPIC
    call(app, scope("POST", "/v1/embeddings", route=None, dialect=Dialect.ANTHROPIC))
    assert inner.scopes[-1][mw.DIALECT] == Dialect.OPENAI


def test_cors_headers_go_only_to_an_allowed_origin() -> None:
    app = mw.Cors(Inner(), Guard(cors_origins=("https://app.example",)))
    allowed = call(app, scope(headers={"origin": "https://app.example"}))
    assert allowed.headers[b"access-control-allow-origin"] == b"https://app.example"
    assert allowed.headers[b"vary"] == b"Origin"
    assert b"access-control-allow-origin" not in call(app, scope()).headers


def test_each_request_gets_its_own_id_in_scope_and_headers() -> None:
    inner = Inner()
    app = mw.RequestId(inner)
    first, second = call(app, scope()), call(app, scope())
    given = first.headers[b"request-id"]
    assert given == first.headers[b"x-request-id"] == inner.scopes[0][mw.REQUEST_ID].encode()
    assert given.startswith(b"req_") and len(given) == 4 + 24
    assert second.headers[b"request-id"] != given


# What each request leaves: the log line and the counters -------------------------------------


def test_the_request_log_has_one_line_with_status_route_and_what_the_response_came_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = Router(Vocab.from_token_bytes([b"<eos>", b"Hi"], [0]))

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        spec = StreamSpec.anthropic(model="m", message_id="msg_1", reply=Reply(eos_ids=[0]))
        scope[mw.READER] = router.open(1, spec, prompt_tokens=5, cached_tokens=2, max_tokens=9)
        router.step([1, 1, 1], [1, 1, 0])
        await send({"type": "http.response.start", "status": 201, "headers": []})

    request = scope(route=MESSAGES)
    request[mw.REQUEST_ID] = "req_1"
    with caplog.at_level(logging.INFO, logger="mlxgate.requests"):
        call(mw.RequestLog(Inner(handler), "served-model"), request)
    (record,) = [r for r in caplog.records if r.name == "mlxgate.requests"]
    fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    assert fields["id"] == "req_1" and fields["status"] == 201
    assert (fields["route"], fields["dialect"], fields["model"]) == (
        "/v1/messages",
        "anthropic",
        "served-model",
    )
    assert fields["end"] == "finished"
    assert (fields["prompt_tokens"], fields["cached_tokens"], fields["output_tokens"]) == (5, 2, 3)


def test_the_request_log_names_an_unrouted_path_and_a_request_that_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="mlxgate.requests"), pytest.raises(RuntimeError):
        call(mw.RequestLog(Inner(raising(RuntimeError())), "m"), scope(path="/nowhere/"))
    (record,) = [r for r in caplog.records if r.name == "mlxgate.requests"]
    fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    assert (fields["route"], fields["status"], fields["end"]) == ("/nowhere", 0, "cancelled")


def test_counters_count_by_route_and_status() -> None:
    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/left":
            raise ClientGone()
        await ok(scope, receive, send)

    registry = CollectorRegistry()
    counted = mw.Counters(Inner(handler), registry)
    call(counted, scope(route=MESSAGES))
    call(counted, scope(route=MESSAGES))
    call(counted, scope("GET", "/v1/models/a", route=MODEL))
    with pytest.raises(ClientGone):
        call(counted, scope(path="/left", route=MESSAGES))

    def value(route: str, status: str) -> float | None:
        labels = {"route": route, "status": status}
        return registry.get_sample_value("mlxgate_http_requests_total", labels)

    assert value("/v1/messages", "200") == 2
    assert value("other", "200") == 1  # a prefix route: not one label per model id
    assert value("/v1/messages", "499") == 1  # no answer: the client left


# Errors in the dialect's envelope ------------------------------------------------------------


def test_envelopes_word_errors_in_the_routes_dialect() -> None:
    error = ApiError(ErrorKind.RATE_LIMITED, "slow down", retry_after_s=3)
    anthropic = call(mw.Envelopes(Inner(raising(error))), scope())
    assert anthropic.status == 429 and anthropic.headers[b"retry-after"] == b"3"
    assert anthropic.json["type"] == "error"
    assert anthropic.json["error"]["type"] == "rate_limit_error"
    openai = call(mw.Envelopes(Inner(raising(error))), scope(dialect=Dialect.OPENAI))
    assert openai.status == 429 and openai.json["error"]["message"] == "slow down"
    too_large = call(mw.Envelopes(Inner(raising(BodyTooLarge(2**20)))), scope())
    assert too_large.status == 413 and "1 MB" in too_large.json["error"]["message"]
    assert call(mw.Envelopes(Inner(raising(ClientGone()))), scope()).messages == []


def test_envelopes_answer_a_bug_with_500_only_before_the_answer_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed = call(mw.Envelopes(Inner(raising(RuntimeError("bug")))), scope())
    assert failed.status == 500 and failed.json["error"]["type"] == "api_error"
    assert "unhandled error on POST /v1/messages" in caplog.text

    async def fails_midway(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("bug")

    midway = call(mw.Envelopes(Inner(fails_midway)), scope())
    assert [m["type"] for m in midway.messages] == ["http.response.start"]


# Who may call ---------------------------------------------------------------------------------


def test_host_guard_refuses_a_rebinding_host_and_a_foreign_origin() -> None:
    app = mw.HostGuard(Inner(), Guard())
    assert call(app, scope(headers={"host": "127.0.0.1:8080"})).status == 200
    assert call(app, scope(headers={"host": "localhost"})).status == 200
    refused = refusal(app, scope(headers={"host": "attacker.example"}))
    assert refused.status(Dialect.ANTHROPIC) == 403
    refused = refusal(app, scope(headers={"host": "localhost", "origin": "https://a.example"}))
    assert refused.status(Dialect.OPENAI) == 403


def test_preflight_is_answered_and_other_options_pass_on() -> None:
    inner = Inner()
    app = mw.Preflight(inner, Guard(cors_origins=("*",)))
    headers = {"origin": "https://a.example", "access-control-request-headers": "x-api-key"}
    answered = call(app, scope("OPTIONS", headers=headers))
    assert answered.status == 204 and not inner.scopes
    assert answered.headers[b"access-control-allow-headers"] == b"x-api-key"
    assert b"POST" in answered.headers[b"access-control-allow-methods"]
    assert call(app, scope("OPTIONS")).status == 200 and len(inner.scopes) == 1


def test_auth_wants_the_key_except_for_health() -> None:
    app = mw.Auth(Inner(), Guard(api_key="sk-right"))
    assert refusal(app, scope()).status(Dialect.OPENAI) == 401
    assert refusal(app, scope(headers={"x-api-key": "sk-wrong"})).status(Dialect.OPENAI) == 401
    assert call(app, scope(headers={"x-api-key": "sk-right"})).status == 200
    assert call(app, scope(headers={"authorization": "Bearer sk-right"})).status == 200
    assert call(app, scope("GET", "/health/")).status == 200
    assert call(mw.Auth(Inner(), Guard()), scope()).status == 200  # no key set


def test_not_found_refuses_a_request_no_route_has() -> None:
    app = mw.NotFound(Inner())
    refused = refusal(app, scope("GET", "/v1/nothing"))
    assert refused.status(Dialect.OPENAI) == 404
    assert "GET /v1/nothing is not a route" in str(refused)
    assert call(app, scope(route=MESSAGES)).status == 200


# Generation requests: drain, rate, body, trace, slots ----------------------------------------


def test_only_posts_go_through_the_generation_wrappers() -> None:
    inner = Inner()
    app = mw.Posts(inner, lambda app: mw.NotFound(app))  # refuses everything it sees
    assert call(app, scope("GET")).status == 200
    refusal(app, scope("POST"))


def test_the_drain_gate_counts_requests_and_refuses_new_ones_while_draining() -> None:
    drain = Drain(7, lambda: None)
    counted: list[int] = []

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        counted.append(drain.in_flight)
        await ok(scope, receive, send)

    app = mw.DrainGate(Inner(handler), drain)
    assert call(app, scope()).status == 200
    assert counted == [1] and drain.in_flight == 0
    drain.draining = True
    refused = refusal(app, scope())
    assert refused.status(Dialect.ANTHROPIC) == refused.status(Dialect.OPENAI) == 503
    assert dict(refused.headers())[b"retry-after"] == b"8"
    assert counted == [1]


def test_the_drain_waits_for_requests_then_stops_the_engine_for_the_rest() -> None:
    stopped: list[float] = []

    async def scenario() -> tuple[list[str], float]:
        loop = asyncio.get_running_loop()
        ended: list[str] = []
        release = asyncio.Event()
        drain = Drain(0.3, lambda: stopped.append(loop.time()))

        async def request(name: str, wait: Callable[[], Awaitable[Any]]) -> None:
            with drain.running():
                await wait()
                ended.append(name)

        quick = asyncio.ensure_future(request("quick", lambda: asyncio.sleep(0.05)))
        slow = asyncio.ensure_future(request("slow", release.wait))
        await asyncio.sleep(0)
        assert drain.in_flight == 2
        began = loop.time()
        loop.call_later(0.5, release.set)  # the engine's end reaches it after the stop
        await drain.settled()
        await asyncio.gather(quick, slow)
        return ended, began

    ended, began = run(scenario())
    assert ended == ["quick", "slow"]
    assert len(stopped) == 1 and stopped[0] - began >= 0.3  # after the whole timeout


DRAINED_PROCESS = """
import asyncio, sys
from mlxgate.api.drain import Drain

async def main():
    drain = Drain(5, lambda: print("engine stopped", flush=True))
    drain.install()
    with drain.running():
        print("ready", flush=True)
        while not drain.draining:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        print("request ended", flush=True)
    await asyncio.sleep(30)  # the drain ends the process first
    print("not drained", flush=True)

asyncio.run(main())
"""


def test_a_stop_signal_drains_then_ends_the_process() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", DRAINED_PROCESS], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    assert child.wait(20) == 0
    assert child.stdout.read().splitlines() == ["request ended", "engine stopped"]


def test_rate_limit_refuses_a_client_past_its_rate() -> None:
    app = mw.RateLimit(Inner(), Guard(rate_limit=2))
    assert call(app, scope()).status == 200
    assert call(app, scope()).status == 200
    refused = refusal(app, scope())
    assert refused.status(Dialect.OPENAI) == 429
    assert call(app, scope(headers={"x-api-key": "another"})).status == 200


def test_body_limit_reads_the_whole_body_into_the_scope() -> None:
    inner = Inner()
    app = mw.BodyLimit(inner, 10)
    parts = (
        {"type": "http.request", "body": b"12345", "more_body": True},
        {"type": "http.request", "body": b"678", "more_body": False},
    )
    call(app, scope(), receiving(*parts))
    assert inner.scopes[0][mw.BODY] == b"12345678"
    too_large = (*parts[:1], {"type": "http.request", "body": b"678901", "more_body": False})
    with pytest.raises(BodyTooLarge):
        call(app, scope(), receiving(*too_large))
    with pytest.raises(ClientGone):
        call(app, scope(), receiving(parts[0]))
    assert len(inner.scopes) == 1


def test_trace_records_generation_requests_only(tmp_path: Path) -> None:
    recorder = trace.Recorder(tmp_path / "trace.jsonl")
    app = mw.Trace(Inner(), recorder)
    for route in (MESSAGES, COUNT, MESSAGES):
        request = scope(route=route, headers={"x-claude-code-session-id": "s1"})
        request[mw.BODY] = b'{"max_tokens": 5}'
        call(app, request)
    turns = trace.read(tmp_path / "trace.jsonl")
    assert [(t.session, t.turn, t.path) for t in turns] == [
        ("s1", 0, "/v1/messages"),
        ("s1", 1, "/v1/messages"),
    ]
    assert turns[0].body == {"max_tokens": 5}
    assert turns[1].after_s is not None  # the first one's end was recorded


def test_slots_hold_a_clients_generations_in_flight() -> None:
    guard = Guard(max_per_client=1)

    async def scenario() -> tuple[int | None, ApiError | None, int | None]:
        release = asyncio.Event()

        async def held(scope: Scope, receive: Receive, send: Send) -> None:
            await release.wait()
            await ok(scope, receive, send)

        app = mw.Slots(Inner(held), guard)
        first = Sent()
        running = asyncio.ensure_future(app(scope(route=MESSAGES), receiving(), first))
        await asyncio.sleep(0)
        refused = None
        try:
            await app(scope(route=MESSAGES), receiving(), Sent())
        except ApiError as exc:
            refused = exc
        counting = Sent()
        release.set()  # counting tokens takes no slot: it goes through while the first runs
        await app(scope(route=COUNT), receiving(), counting)
        await running
        return first.status, refused, counting.status

    first, refused, counting = run(scenario())
    assert first == 200 and counting == 200
    assert refused is not None and refused.status(Dialect.OPENAI) == 429
    assert call(mw.Slots(Inner(), guard), scope(route=MESSAGES)).status == 200  # freed


def test_dispatch_calls_the_routes_handler_with_the_body() -> None:
    got: list[bytes] = []

    async def handler(scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        got.append(body)
        await ok(scope, receive, send)

    route = Route("POST", "/v1/messages", Dialect.ANTHROPIC, handler)
    with_body = scope(route=route)
    with_body[mw.BODY] = b"{}"
    assert call(mw.dispatch, with_body).status == 200
    call(mw.dispatch, scope("GET", route=route))
    assert got == [b"{}", b""]
