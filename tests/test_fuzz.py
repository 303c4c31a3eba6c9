"""Every route under fuzzed input (hypothesis): whatever a client sends, the answer is a 2xx, or
a 4xx in the route's own dialect envelope; never a 5xx, and the server keeps serving.

The real app and model in this process (an ASGI transport), with replies capped at 2 tokens so
that the bodies that happen to be valid cost little. Malformed JSON, wrong types, huge and
negative numbers, deep nesting, invalid UTF-8, lone surrogates, NUL bytes, unknown content
blocks, truncated bodies; a valid body with one part replaced by anything. Slow headers and a
10 MB string are tried once each, against the real server.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import orjson
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from mlxgate.app import App
from support.in_process import InProcessServer
from support.servers import RunningServer

HOST = "http://mlxgate.test"
EXAMPLES = 120

ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
OPENAI = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

VALID: dict[str, dict[str, Any]] = {
    "/v1/messages": {
        "model": "m",
        "max_tokens": 2,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
    },
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/chat/completions": {
        "model": "m",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    },
    "/v1/completions": {"model": "m", "max_tokens": 2, "prompt": "Once upon"},
    "/v1/responses": {"model": "m", "max_output_tokens": 2, "input": "Hi", "instructions": "Hi"},
}

# Any JSON value: strings with NULs and lone surrogates, huge and negative numbers, nesting.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
    | st.sampled_from(["\x00", "\ud800", "", "image", "tool_use", "user", "stream", "-1"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def _encode(value: Any) -> bytes:
    """JSON as a client may write it: lone surrogates escaped (`\\ud800`), which orjson
    refuses to write."""
    import json

    return json.dumps(value).encode()


@pytest.fixture(scope="module")
def app(in_process: InProcessServer) -> App:
    """The in-process app's engine, behind an app whose replies are capped at 2 tokens."""
    from mlxgate.config import Config

    config = Config(max_output_tokens=2, allowed_hosts=("mlxgate.test",))
    return App(in_process.app.models, config)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _send(
    app: App, loop: asyncio.AbstractEventLoop, method: str, path: str, body: bytes
) -> httpx2.Response:
    async def go() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, timeout=120) as client:
            headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
            response = await client.request(method, HOST + path, content=body, headers=headers)
            await response.aread()
            return response

    return loop.run_until_complete(go())


def _assert_answered(response: httpx2.Response, path: str) -> None:
    status = response.status_code
    if currently_in_test_context():
        event(f"{path} {status}")  # the statistics show how much got past validation
    assert status < 500, (status, response.text[:500])
    if status < 400:
        return
    error = response.json()
    if path in ANTHROPIC:
        assert error["type"] == "error", error
        assert isinstance(error["error"]["type"], str) and error["error"]["message"], error
    else:
        assert isinstance(error["error"]["message"], str) and error["error"]["message"], error


def _still_serving(app: App, loop: asyncio.AbstractEventLoop) -> None:
    path = "/v1/messages"
    response = _send(app, loop, "POST", path, orjson.dumps(VALID[path]))
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PATHS = st.sampled_from([*ANTHROPIC, *OPENAI])


@FUZZ
@given(path=PATHS, body=st.binary(max_size=200))
def test_any_bytes(app: App, loop: asyncio.AbstractEventLoop, path: str, body: bytes) -> None:
    _assert_answered(_send(app, loop, "POST", path, body), path)


@FUZZ
@given(path=PATHS, value=values)
def test_any_json(app: App, loop: asyncio.AbstractEventLoop, path: str, value: Any) -> None:
    _assert_answered(_send(app, loop, "POST", path, _encode(value)), path)


def _paths_in(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (keys and indices from the root)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths_in(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths_in(inner, (*prefix, index))
    return found


def _replaced(value: Any, where: tuple[Any, ...], new: Any) -> Any:
    if not where:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[where[0]] = _replaced(value[where[0]], where[1:], new)
    return copy


@FUZZ
@given(path=PATHS, data=st.data(), new=values, stream=st.booleans())
def test_a_valid_body_with_one_part_replaced(
    app: App,
    loop: asyncio.AbstractEventLoop,
    path: str,
    data: st.DataObject,
    new: Any,
    stream: bool,
) -> None:
    body = {**VALID[path], **({"stream": True} if stream and "count" not in path else {})}
    where = data.draw(st.sampled_from(_paths_in(body)[1:]))
    _assert_answered(_send(app, loop, "POST", path, _encode(_replaced(body, where, new))), path)


@FUZZ
@given(path=PATHS, data=st.data())
def test_a_truncated_body(
    app: App, loop: asyncio.AbstractEventLoop, path: str, data: st.DataObject
) -> None:
    body = orjson.dumps(VALID[path])
    cut = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
    _assert_answered(_send(app, loop, "POST", path, body[:cut]), path)


@FUZZ
@given(
    path=st.sampled_from(["/v1/messages", "/v1/chat/completions"]),
    block=st.dictionaries(st.text(max_size=10), values, max_size=3),
    kind=st.text(max_size=12) | st.sampled_from(["image", "document", "tool_result", "thinking"]),
)
def test_unknown_and_malformed_content_blocks(
    app: App, loop: asyncio.AbstractEventLoop, path: str, block: dict[str, Any], kind: str
) -> None:
    body = dict(VALID[path])
    body["messages"] = [{"role": "user", "content": [{**block, "type": kind}]}]
    _assert_answered(_send(app, loop, "POST", path, _encode(body)), path)


def test_deep_nesting_invalid_utf8_and_the_server_goes_on(
    app: App, loop: asyncio.AbstractEventLoop
) -> None:
    for path in (*ANTHROPIC, *OPENAI):
        deep = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        _assert_answered(_send(app, loop, "POST", path, deep), path)
        body = orjson.dumps(VALID[path]).replace(b"Hi", b"H\xff\xfe\x00i")
        _assert_answered(_send(app, loop, "POST", path, body), path)
    for method, path in (("GET", "/v1/models/%00%ff"), ("DELETE", "/v1/responses/..%2f")):
        _assert_answered(_send(app, loop, method, path, b""), "/v1/chat/completions")
    _still_serving(app, loop)


def test_a_ten_megabyte_string_is_refused_in_its_dialect(server: RunningServer) -> None:
    text = "word " * (2 << 20)  # 10 MB
    for path in ("/v1/messages", "/v1/chat/completions"):
        body = {**VALID[path], "messages": [{"role": "user", "content": text}]}
        response = httpx.post(server.url + path, json=body, timeout=120)
        assert 400 <= response.status_code < 500, response.text[:300]
        assert "too long" in response.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_client_that_never_finishes_its_headers_is_dropped(server: RunningServer) -> None:
    """Slowloris: headers that never end hold a connection 10 s (server.py), and others are
    served meanwhile."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-a: 1\r\n")
        slow.settimeout(30)
        started = time.monotonic()
        assert httpx.get(server.url + "/v1/models").status_code == 200
        assert slow.recv(1024) == b""  # closed by the server
        assert 5 < time.monotonic() - started < 20
