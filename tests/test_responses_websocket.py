"""The Responses API over a WebSocket, as Codex's `supports_websockets` and the openai SDK's
`responses.connect()` use it, against a real server with the embedded model: the same events as
the HTTP stream, follow-ups that send only new items, the prewarm, errors that leave the socket
open, the handshake's checks, a close that cancels, keep-alives."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect
from websockets.sync.connection import Connection
from websockets.typing import Origin

from mlxgate._native import Dialect, ErrorKind
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Message, refuse_websocket
from mlxgate.api.responses.websocket import MAX_WAITING
from support.servers import RunningServer, metric, start_server, stop_server

QUESTION = "What is the capital of France?"
DEVELOPER = {"type": "message", "role": "developer", "content": "Answer in one word."}
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def ws_url(server: RunningServer, path: str = "/v1/responses") -> str:
    return server.url.replace("http://", "ws://") + path


def answer(ws: Connection, body: dict[str, Any] | str | bytes) -> list[dict[str, Any]]:
    """The events answering one message, up to the one that ends it."""
    ws.send(body if isinstance(body, str | bytes) else create(body))
    return next_answer(ws)


def create(body: dict[str, Any]) -> str:
    return json.dumps({"type": "response.create", **body})


def next_answer(ws: Connection) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ENDS:
        events.append(json.loads(ws.recv(timeout=120)))
    return events


def sse_data(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


def without(value: Any, keys: set[str]) -> Any:
    """`value` with the members named `keys` left out, at any depth."""
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def test_a_response_over_websocket_is_the_http_stream_one_message_per_event(
    server: RunningServer,
) -> None:
    body: dict[str, Any] = {"model": "m", "input": QUESTION, "instructions": "Answer in one word."}
    body |= {"max_output_tokens": 24, "store": False}
    http = httpx.post(f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120)
    with connect(ws_url(server)) as ws:
        events = answer(ws, body)
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # Ids and times differ; how much of the prompt the prefix cache held differs.
    volatile = {"id", "item_id", "created_at", "cached_tokens"}
    assert without(events, volatile) == without(sse_data(http.text), volatile)
    assert "Paris" in text_of(events[-1]["response"])


def test_the_openai_sdks_connect_streams_a_response(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)
    with client.responses.connect() as connection:
        connection.response.create(model="m", input=QUESTION, max_output_tokens=24, store=False)
        kinds = []
        for event in connection:
            kinds.append(event.type)
            if event.type == "response.completed":
                assert "Paris" in event.response.output_text
                break
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds


def test_follow_ups_send_only_new_items_after_a_prewarm(server: RunningServer) -> None:
    """Codex's way, `store: false`: a prewarm with the developer message that runs no model,
    then each turn sends only its new items with the last response's id. The connection keeps
    the conversation: each turn's prompt is the whole of it, and the prefix cache holds the
    last turn's."""
    computed = metric(server, "mlxgate_engine_prefill_tokens_total")
    common = {"model": "m", "store": False, "max_output_tokens": 16}
    with connect(ws_url(server)) as ws:
        prewarm = answer(ws, {**common, "input": [DEVELOPER], "generate": False})
        assert [e["type"] for e in prewarm] == [
            "response.created",
            "response.in_progress",
            "response.completed",
        ]
        assert prewarm[-1]["response"]["output"] == []
        assert metric(server, "mlxgate_engine_prefill_tokens_total") == computed
        first = {"role": "user", "content": QUESTION}
        previous = prewarm[-1]["response"]["id"]
        turn1 = answer(ws, {**common, "previous_response_id": previous, "input": [first]})[-1]
        assert "Paris" in text_of(turn1["response"])
        second = {"role": "user", "content": "And of Germany?"}
        previous = turn1["response"]["id"]
        turn2 = answer(ws, {**common, "previous_response_id": previous, "input": [second]})[-1]
    done1, done2 = turn1["response"], turn2["response"]
    assert "Berlin" in text_of(done2)
    usage1, usage2 = done1["usage"], done2["usage"]
    assert usage2["input_tokens_details"]["cached_tokens"] >= usage1["input_tokens"] - 1
    # The whole conversation sent over HTTP: the same prompt, the same answer.
    whole = [DEVELOPER, first, *done1["output"], second]
    http = httpx.post(
        f"{server.url}/v1/responses", json={**common, "input": whole}, timeout=120
    ).json()
    assert http["usage"]["input_tokens"] == usage2["input_tokens"]
    assert text_of(http) == text_of(done2)


def test_a_stored_response_is_continued_from_another_connection(server: RunningServer) -> None:
    common = {"model": "m", "max_output_tokens": 16}
    with connect(ws_url(server)) as ws:
        stored = answer(ws, {**common, "input": [DEVELOPER, {"role": "user", "content": QUESTION}]})
    response_id = stored[-1]["response"]["id"]
    assert httpx.get(f"{server.url}/v1/responses/{response_id}").json()["id"] == response_id
    follow_up = {"role": "user", "content": "And of Germany?"}
    with connect(ws_url(server)) as ws:
        done = answer(ws, {**common, "previous_response_id": response_id, "input": [follow_up]})
    assert "Berlin" in text_of(done[-1]["response"])


def test_a_bad_message_gets_an_error_and_the_socket_answers_the_next(
    server: RunningServer,
) -> None:
    too_long = " ".join(["word"] * 9000)  # past the 8,192-token context
    bad: list[tuple[str | bytes | dict[str, Any], int, str | None, str | None]] = [
        ("not json", 400, None, None),
        (b"binary", 400, None, None),
        (json.dumps({"type": "response.cancel"}), 400, "type", None),
        ({"input": "hi", "temperature": 3}, 400, None, None),
        (
            {"input": "hi", "previous_response_id": "resp_unknown"},
            404,
            "previous_response_id",
            None,
        ),
        ({"input": too_long}, 400, "input", "context_length_exceeded"),
    ]
    with connect(ws_url(server)) as ws:
        for message, status, param, code in bad:
            events = answer(ws, message)
            assert len(events) == 1, events
            error = events[0]
            assert (error["type"], error["status"]) == ("error", status), error
            assert (error["error"]["param"], error["error"]["code"]) == (param, code), error
            assert error["error"]["message"]
        done = answer(ws, {"model": "m", "input": QUESTION, "max_output_tokens": 16})
    assert done[-1]["type"] == "response.completed"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'mlxgate_websocket_responses_total{route="/v1/responses",status="404"}' in metrics


def test_a_base_url_prefix_is_served_and_other_paths_are_not_found(server: RunningServer) -> None:
    with connect(ws_url(server, "/some/prefix/v1/responses")) as ws:
        done = answer(ws, {"model": "m", "input": QUESTION, "max_output_tokens": 16})
    assert done[-1]["type"] == "response.completed"
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server, "/v1/chat/completions"))
    assert refused.value.response.status_code == 404


def test_a_web_pages_origin_is_refused(server: RunningServer) -> None:
    """A page can open a WebSocket to any address, and no CORS check stops it: the handshake
    is refused unless the origin is allowed (`--cors-origins`), as an HTTP request is."""
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server), origin=Origin("https://evil.example"))
    response = refused.value.response
    assert response.status_code == 403
    assert "evil.example" in json.loads(response.body or b"{}")["error"]["message"]


def test_messages_sent_ahead_are_answered_in_turn(server: RunningServer) -> None:
    questions = [QUESTION, "What is the capital of Germany?"]
    with connect(ws_url(server)) as ws:
        for question in questions:
            ws.send(create({"input": question, "max_output_tokens": 16}))
        answers = [text_of(next_answer(ws)[-1]["response"]) for _ in questions]
    assert "Paris" in answers[0] and "Berlin" in answers[1], answers


def test_a_client_that_queues_too_many_messages_is_closed(server: RunningServer) -> None:
    """Bounded: one message answered and MAX_WAITING waiting; past that the socket is closed
    (1008) and the response being generated is cancelled."""
    essay = {"input": "Write a very long essay about the sea.", "max_output_tokens": 2000}
    with connect(ws_url(server)) as ws:
        for _ in range(MAX_WAITING + 4):
            ws.send(create(essay))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=120)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    deadline = time.monotonic() + 60
    while metric(server, "mlxgate_engine_running") > 0:
        assert time.monotonic() < deadline, "the answered response kept generating"
        time.sleep(0.05)


def test_a_refusal_is_a_close_where_the_server_has_no_denial_responses() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    error = ApiError(ErrorKind.AUTHENTICATION, "no key")
    asyncio.run(refuse_websocket({"type": "websocket"}, send, error, Dialect.RESPONSES))
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_closing_mid_response_cancels_it_and_the_server_goes_on(server: RunningServer) -> None:
    cancelled = metric(server, "mlxgate_engine_requests_cancelled_total")
    essay = {"role": "user", "content": "Write a very long essay about the sea."}
    with connect(ws_url(server)) as ws:
        ws.send(create({"input": [essay], "max_output_tokens": 2000}))
        while json.loads(ws.recv(timeout=120))["type"] != "response.output_text.delta":
            pass
    # The abandoned 2000-token generation leaves the batch (no wall-clock bound: shared machine).
    deadline = time.monotonic() + 60
    while metric(server, "mlxgate_engine_running") > 0:
        assert time.monotonic() < deadline, "the cancelled response kept generating"
        time.sleep(0.05)
    assert metric(server, "mlxgate_engine_requests_cancelled_total") == cancelled + 1
    assert "WS /v1/responses 200 cancelled: " in server.log()
    decoded = metric(server, "mlxgate_engine_decode_tokens_total")
    time.sleep(0.5)
    assert metric(server, "mlxgate_engine_decode_tokens_total") == decoded
    with connect(ws_url(server)) as ws:
        done = answer(ws, {"model": "m", "input": QUESTION, "max_output_tokens": 16})
    assert done[-1]["type"] == "response.completed"


KEY = "sk-ws"
PING_S = 0.05
LONG_PROMPT = " ".join(f"Item {i} is on the shelf." for i in range(60)) + " Which item is first?"


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """An API key, and prompts prefilled 32 tokens a step with keep-alives every 50 ms."""
    running = start_server(
        tmp_path_factory.mktemp("websocket"),
        "--context-length", "8192",
        "--api-key", KEY,
        "--ping-interval-s", str(PING_S),
        "--max-prefill-chunk", "32",
        "--max-prefill-tokens", "32",
        "--prefix-cache-mb", "0",
    )  # fmt: skip
    yield running
    stop_server(running)


def test_the_api_key_is_checked_at_the_handshake(guarded_server: RunningServer) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(guarded_server), additional_headers=headers)
        response = refused.value.response
        assert response.status_code == 401
        assert json.loads(response.body or b"{}")["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}"}
    with connect(ws_url(guarded_server), additional_headers=auth) as ws:
        done = answer(ws, {"model": "m", "input": "Hi", "max_output_tokens": 2})
    assert done[-1]["type"] == "response.incomplete"
    metrics = httpx.get(f"{guarded_server.url}/metrics", headers=auth).text
    assert 'mlxgate_websocket_connections_total{route="/v1/responses",status="401"} 2.0' in metrics
    assert 'mlxgate_websocket_connections_total{route="/v1/responses",status="101"} 1.0' in metrics


def test_a_long_prefill_keeps_the_socket_alive_with_in_progress_events(
    guarded_server: RunningServer,
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with connect(ws_url(guarded_server), additional_headers=auth) as ws:
        events = answer(ws, {"model": "m", "input": LONG_PROMPT, "max_output_tokens": 5})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete"
    before_text = kinds[: kinds.index("response.output_item.added")]
    assert before_text.count("response.in_progress") >= 4, kinds
