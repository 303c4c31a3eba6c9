"""The real server with the real model, driven by the official anthropic SDK and raw httpx."""

from __future__ import annotations

import secrets
import time

import anthropic
import httpx
import orjson
import pytest

from support.servers import RunningServer, metric

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-local", max_retries=0)


def count_tokens(client: anthropic.Anthropic, **kwargs: object) -> int:
    return client.messages.count_tokens(model="claude-test", **kwargs).input_tokens  # type: ignore[arg-type]


def test_create_answers_the_question(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-test",
        max_tokens=64,
        messages=QUESTION,  # type: ignore[arg-type]
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    assert "Paris" in text
    assert message.stop_reason == "end_turn"
    assert message.model == "SmolLM2-135M-Instruct"
    assert message.id.startswith("msg_")
    usage = message.usage
    assert usage.cache_read_input_tokens is not None
    assert usage.input_tokens + usage.cache_read_input_tokens == count_tokens(
        client, messages=QUESTION
    )
    assert 1 < usage.output_tokens < 64


def test_stream_answers_the_question(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="claude-test",
        max_tokens=64,
        messages=QUESTION,  # type: ignore[arg-type]
    ) as stream:
        deltas = [event.delta.text for event in stream if event.type == "content_block_delta"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert len(deltas) > 1, "text arrives token by token, not in one piece"
    assert "Paris" in "".join(deltas)
    assert final.content[0].text == "".join(deltas)  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    usage = final.usage
    assert usage.cache_read_input_tokens is not None
    assert usage.input_tokens + usage.cache_read_input_tokens == count_tokens(
        client, messages=QUESTION
    )
    assert final.usage.output_tokens > 1


def test_max_tokens_stops_exactly(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-test",
        max_tokens=5,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5


def test_system_as_string_or_blocks_renders_the_same(client: anthropic.Anthropic) -> None:
    as_string = count_tokens(client, system="You are terse.", messages=QUESTION)
    as_blocks = count_tokens(
        client, system=[{"type": "text", "text": "You are terse."}], messages=QUESTION
    )
    assert as_string == as_blocks
    assert as_string != count_tokens(client, messages=QUESTION)
    message = client.messages.create(
        model="claude-test",
        max_tokens=16,
        system=[{"type": "text", "text": "You are terse."}],
        messages=QUESTION,  # type: ignore[arg-type]
    )
    assert message.usage.cache_read_input_tokens is not None
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == as_string


def _events(raw: bytes) -> list[tuple[str, dict[str, object]]]:
    """Each frame's event and data, checked to be numbered 1, 2, ... (SSE `id:`)."""
    events: list[tuple[str, dict[str, object]]] = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert lines[0] == f"id: {len(events) + 1}", frame
        assert lines[1].startswith("event: ") and lines[2].startswith("data: "), frame
        events.append((lines[1][len("event: ") :], orjson.loads(lines[2][len("data: ") :])))
    return events


def test_raw_stream_event_order_and_timing(server: RunningServer) -> None:
    body = {
        "model": "claude-test",
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
    }
    arrivals: list[tuple[float, bytes]] = []
    with httpx.Client(timeout=60) as http:
        started = time.monotonic()
        with http.stream("POST", f"{server.url}/v1/messages?beta=true", json=body) as response:
            headers_at = time.monotonic() - started
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in response.iter_raw():
                arrivals.append((time.monotonic() - started, chunk))
    raw = b"".join(chunk for _, chunk in arrivals)
    events = _events(raw)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    for name, data in events:
        assert data["type"] == name
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] > 0 and start["content"] == []  # type: ignore[index]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")  # type: ignore[index]
    assert delta["usage"]["output_tokens"] == len(names[3:-3]) + (  # type: ignore[index]
        1 if delta["delta"]["stop_reason"] == "end_turn" else 0  # type: ignore[index]
    )
    # Headers and message_start go out before generation ends, then tokens trickle in.
    first_data_at = arrivals[0][0]
    last_data_at = arrivals[-1][0]
    assert b"message_start" in arrivals[0][1]
    assert headers_at < last_data_at and first_data_at < last_data_at
    assert len(arrivals) > 5


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (orjson.dumps({"model": "x", "max_tokens": 5}), "messages"),
        (
            orjson.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
        (
            orjson.dumps(
                {"model": "x", "max_tokens": 5, "messages": [{"role": "bot", "content": "hi"}]}
            ),
            "role",
        ),
    ],
)
def test_bad_requests_get_anthropic_400(server: RunningServer, body: bytes, expected: str) -> None:
    response = httpx.post(f"{server.url}/v1/messages", content=body, timeout=10)
    assert response.status_code == 400
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert expected in payload["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_sdk_raises_bad_request_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="claude-test", max_tokens=0, messages=QUESTION)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    assert "max_tokens" in str(caught.value)


def test_unknown_route_is_404_in_anthropic_envelope(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/v1/nothing-here", json={})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_prompt_too_long_has_the_exact_wording(client: anthropic.Anthropic) -> None:
    long_text = "word " * 9000
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="claude-test", max_tokens=10, messages=[{"role": "user", "content": long_text}]
        )
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    tokens = count_tokens(client, messages=[{"role": "user", "content": long_text}])
    assert message == f"prompt is too long: {tokens} tokens > 8192 maximum"


def test_models_and_health(server: RunningServer) -> None:
    openai_shape = httpx.get(f"{server.url}/v1/models").json()
    assert openai_shape["object"] == "list"
    assert openai_shape["data"][0]["id"] == "SmolLM2-135M-Instruct"
    anthropic_shape = httpx.get(
        f"{server.url}/v1/models", headers={"anthropic-version": "2023-06-01"}
    ).json()
    assert anthropic_shape["data"][0]["type"] == "model"
    assert anthropic_shape["has_more"] is False
    assert httpx.get(f"{server.url}/health").json()["model"] == "SmolLM2-135M-Instruct"


def test_disconnect_mid_stream_cancels_generation(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    body = {
        "model": "claude-test",
        "max_tokens": 2000,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long essay about the sea."}],
    }
    cancelled = metric(server, "mlxgate_engine_requests_cancelled_total")
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/messages", json=body) as response,
    ):
        for chunk in response.iter_raw():
            if b"content_block_delta" in chunk:
                break
    # The abandoned 2000-token generation leaves the batch (no wall-clock bound: shared machine).
    deadline = time.monotonic() + 60
    while metric(server, "mlxgate_engine_running") > 0:
        assert time.monotonic() < deadline, "the cancelled stream kept generating"
        time.sleep(0.05)
    assert metric(server, "mlxgate_engine_requests_cancelled_total") == cancelled + 1
    decoded = metric(server, "mlxgate_engine_decode_tokens_total")
    time.sleep(0.5)
    assert metric(server, "mlxgate_engine_decode_tokens_total") == decoded
    message = client.messages.create(model="claude-test", max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]
    assert message.usage.output_tokens >= 1


def test_a_prompt_dropped_mid_prefill_is_resumed_by_its_retry(server: RunningServer) -> None:
    """Claude Code gives up on a stream that stays silent and sends the request again: the
    chunks prefilled before the first client left are reused, and only the rest is computed."""
    nonce = secrets.token_hex(4)
    words = " ".join(f"ab{i}" for i in range(900))  # ~3,500 tokens
    body = {
        "model": "claude-test",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": f"{nonce}: count these: {words}"}],
    }
    prefilled = metric(server, "mlxgate_engine_prefill_tokens_total")
    cancelled = metric(server, "mlxgate_engine_requests_cancelled_total")
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True}) as first,
    ):
        assert first.status_code == 200
        # What the first try found cached (the chat template's opening, from other requests).
        lines = first.iter_lines()  # kept: a generator closed early closes the response
        opening = next(line for line in lines if line.startswith("data:"))
        reused = orjson.loads(opening[5:])["message"]["usage"]["cache_read_input_tokens"]
        deadline = time.monotonic() + 60
        while metric(server, "mlxgate_engine_prefill_tokens_total") < prefilled + 512:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 60
    while metric(server, "mlxgate_engine_requests_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the dropped prompt was not cancelled"
        time.sleep(0.05)
    before_retry = metric(server, "mlxgate_engine_prefill_tokens_total")
    dropped_after = before_retry - prefilled

    retry = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120).json()
    usage = retry["usage"]
    prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert reused + 512 <= usage["cache_read_input_tokens"] <= reused + dropped_after
    assert usage["cache_read_input_tokens"] < prompt_tokens - 256  # dropped mid-prefill
    computed = metric(server, "mlxgate_engine_prefill_tokens_total") - before_retry
    assert computed == prompt_tokens - 1 - usage["cache_read_input_tokens"]
