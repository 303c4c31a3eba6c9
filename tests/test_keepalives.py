"""Keep-alives that every SSE client reads: the frames a stream writes while its prompt waits or
prefills, fed to each official SDK's own decoder and httpx-sse, then streamed through the SDKs
from the real server across prefills and queues longer than the keep-alive interval.

An SSE comment (`: keep-alive`) is legal SSE, but a decoder that keeps the last event id (the
openai SDK's, httpx-sse's) dispatches the blank line after it as an event with empty data, which
the openai SDK then fails to parse as JSON. Chat Completions therefore keep alive with an empty
chunk; Anthropic streams with `ping` events and Responses streams with `response.in_progress`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from httpx_sse import EventSource
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent

from mlxgate._native import FinishReason, Reply, Router, StreamSpec, Vocab
from support.servers import RunningServer, start_server, stop_server

EOS = 3
_RAW_VOCAB = [b"Hello", b" world", b"!", b"</s>"]


def _spec(dialect: str) -> StreamSpec:
    common: dict[str, Any] = {"model": "smol", "reply": Reply(eos_ids=[EOS])}
    if dialect == "anthropic":
        return StreamSpec.anthropic(message_id="msg_1", **common)
    if dialect == "responses":
        echo = json.dumps({"tools": [], "text": {"format": {"type": "text"}}, "metadata": {}})
        return StreamSpec.responses(
            response_id="resp_1", created_at=1_700_000_000, echo=echo[1:-1], **common
        )
    kind: Literal["chat", "completion"] = "completion" if dialect == "completion" else "chat"
    return StreamSpec.openai(
        completion_id="cmpl-1", created=1_700_000_000, kind=kind, include_usage=True, **common
    )


def stream_bytes(dialect: str) -> bytes:
    """A whole stream as the server sends it: numbered events, keep-alives while the prompt
    waits, then three tokens and the end of the turn."""
    router = Router(Vocab.from_token_bytes(_RAW_VOCAB, [EOS]))
    reader = router.open(1, _spec(dialect), prompt_tokens=4, cached_tokens=0, max_tokens=100)
    out = bytearray()
    for _ in range(3):
        router.ping(1)
    for token in (0, 1, 2):
        assert router.step([1], [token]) == []
    assert router.step([1], [EOS]) == [(1, FinishReason.END_TURN)]
    while (data := reader.take()) is not None:
        out += data
    return bytes(out)


def _response(body: bytes) -> httpx2.Response:
    request = httpx2.Request("POST", "http://127.0.0.1/v1/x")
    return httpx2.Response(200, content=body, request=request)


def openai_events(body: bytes, cast_to: type[Any]) -> list[Any]:
    client = openai.OpenAI(api_key="sk-local", base_url="http://127.0.0.1/v1")
    return list(openai.Stream(cast_to=cast_to, response=_response(body), client=client))


def anthropic_events(body: bytes) -> list[Any]:
    client = anthropic.Anthropic(api_key="sk-local", base_url="http://127.0.0.1")
    # The events are a union, which the SDK's `cast_to: type[_T]` cannot take (its own streams
    # get theirs from `stream_cls`).
    stream: anthropic.Stream[RawMessageStreamEvent] = anthropic.Stream(
        cast_to=RawMessageStreamEvent,  # type: ignore[arg-type]
        response=_response(body),
        client=client,
    )
    return list(stream)


def httpx_sse_payloads(body: bytes) -> list[Any]:
    """Every event's data as JSON, the way a plain httpx-sse client reads a stream."""
    response = httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    return [
        json.loads(sse.data) for sse in EventSource(response).iter_sse() if sse.data != "[DONE]"
    ]


def test_a_comment_after_an_event_id_breaks_the_openai_sdk() -> None:
    """What the keep-alives used to be, and why they are not comments any more."""
    chunk = stream_bytes("chat").split(b"\n\n")[0].split(b"\n", 1)[1]  # the role chunk's data
    with pytest.raises(json.JSONDecodeError):
        openai_events(b"id: 1\n" + chunk + b"\n\n: keep-alive\n\n", ChatCompletionChunk)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_openai_keepalives_are_chunks_every_decoder_reads(kind: str) -> None:
    body = stream_bytes(kind)
    assert b"\n:" not in b"\n" + body, "no SSE comment"
    chunks = openai_events(body, ChatCompletionChunk if kind == "chat" else Completion)
    payloads = httpx_sse_payloads(body)
    assert len(chunks) == len(payloads)
    with_choices = [c for c in chunks if c.choices]
    if kind == "chat":
        role, *pings = with_choices[:4]
        assert role.choices[0].delta.role == "assistant"
        assert [(p.choices[0].delta.content, p.choices[0].finish_reason) for p in pings] == [
            (None, None)
        ] * 3
        text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    else:
        assert [(c.choices[0].text, c.choices[0].finish_reason) for c in with_choices[:3]] == [
            ("", None)
        ] * 3
        text = "".join(c.choices[0].text for c in with_choices)
    assert text == "Hello world!"
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_anthropic_keepalives_are_ping_events_every_decoder_reads() -> None:
    body = stream_bytes("anthropic")
    events = anthropic_events(body)
    payloads = httpx_sse_payloads(body)
    assert [p["type"] for p in payloads].count("ping") == 4  # one after message_start
    assert [e.type for e in events] == [p["type"] for p in payloads if p["type"] != "ping"]
    assert events[-1].type == "message_stop"


def test_responses_keepalives_are_in_progress_events_every_decoder_reads() -> None:
    body = stream_bytes("responses")
    events = openai_events(body, ResponseStreamEvent)  # type: ignore[arg-type]
    payloads = httpx_sse_payloads(body)
    assert [e["type"] for e in payloads].count("response.in_progress") == 4
    assert [e.type for e in events] == [p["type"] for p in payloads]
    assert events[-1].type == "response.completed"


# The real server: keep-alives every 50 ms, prompts prefilled 32 tokens a step, one sequence
# decoded at a time (a second request waits in the queue), with and without resumable streams.
PING_S = 0.05
LONG_PROMPT = " ".join(f"Item {i} is on the shelf." for i in range(60)) + " Which item is first?"


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "resumable"])
def slow_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    resume = ["--resume-window", "30"] if request.param else []
    running = start_server(
        tmp_path_factory.mktemp("keepalive"),
        "--context-length", "8192",
        "--ping-interval-s", str(PING_S),
        "--max-prefill-chunk", "32",
        "--max-prefill-tokens", "32",
        "--max-running", "1",
        "--prefix-cache-mb", "0",
        *resume,
    )  # fmt: skip
    yield running
    stop_server(running)


class Recorded(httpx2.BaseTransport):
    """Passes requests through and keeps the raw bytes of every response body it streams."""

    def __init__(self) -> None:
        self.inner = httpx2.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        raw, stream = self.raw, response.stream
        assert isinstance(stream, httpx2.SyncByteStream)
        upstream: httpx2.SyncByteStream = stream

        class Tee(httpx2.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in upstream:
                    raw.extend(chunk)
                    yield chunk

            def close(self) -> None:
                upstream.close()

        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=Tee(),
            extensions=response.extensions,
        )


def sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[len(b"data: ") :])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {")
    ]


def openai_client(server: RunningServer, recorded: Recorded) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-local",
        base_url=f"{server.url}/v1",
        http_client=httpx2.Client(transport=recorded),
        max_retries=0,
    )


def keepalives_before_text(raw: bytes) -> int:
    """Empty chunks (chat: no role, no content; completion: no text) before the first text."""
    count = 0
    for chunk in sse_payloads(raw):
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {"content": choice.get("text")})
            if delta.get("content") or choice["finish_reason"]:
                return count
            if delta in ({}, {"content": ""}) and "role" not in delta:
                count += 1
    return count


@pytest.mark.parametrize("n", [1, 2])
def test_openai_sdk_streams_a_chat_completion_across_a_long_prefill(
    slow_server: RunningServer, n: int
) -> None:
    recorded = Recorded()
    stream = openai_client(slow_server, recorded).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=5,
        n=n,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finished = {c.index for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert finished == set(range(n))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5 * n
    assert keepalives_before_text(bytes(recorded.raw)) >= 3, bytes(recorded.raw)[:2000]


def test_openai_sdk_streams_a_completion_across_a_long_prefill(
    slow_server: RunningServer,
) -> None:
    recorded = Recorded()
    stream = openai_client(slow_server, recorded).completions.create(
        model="smollm2", prompt=LONG_PROMPT, max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert keepalives_before_text(bytes(recorded.raw)) >= 3, bytes(recorded.raw)[:2000]


def test_openai_sdk_streams_behind_a_full_queue(slow_server: RunningServer) -> None:
    """A request that waits for another's whole generation (one sequence runs at a time)."""
    started = threading.Event()

    def occupy() -> None:
        body = {"model": "m", "prompt": "Count:", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body) as response:
            for _ in response.iter_bytes():
                started.set()

    blocker = threading.Thread(target=occupy)
    blocker.start()
    try:
        assert started.wait(60)
        recorded = Recorded()
        stream = openai_client(slow_server, recorded).chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=3,
            n=2,
            stream=True,
        )
        assert {c.index for chunk in stream for c in chunk.choices if c.finish_reason} == {0, 1}
        assert keepalives_before_text(bytes(recorded.raw)) >= 3
    finally:
        blocker.join()


def test_anthropic_sdk_streams_across_a_long_prefill(slow_server: RunningServer) -> None:
    recorded = Recorded()
    client = anthropic.Anthropic(
        api_key="sk-local",
        base_url=slow_server.url,
        http_client=httpx2.Client(transport=recorded),
        max_retries=0,
    )
    with client.messages.stream(
        model="smollm2", max_tokens=5, messages=[{"role": "user", "content": LONG_PROMPT}]
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    kinds = [p["type"] for p in sse_payloads(bytes(recorded.raw))]
    assert kinds.count("ping") >= 4, kinds


def test_responses_stream_across_a_long_prefill(slow_server: RunningServer) -> None:
    recorded = Recorded()
    events = list(
        openai_client(slow_server, recorded).responses.create(
            model="smollm2", input=LONG_PROMPT, max_output_tokens=5, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    kinds = [p["type"] for p in sse_payloads(bytes(recorded.raw))]
    assert kinds.count("response.in_progress") >= 4, kinds


@pytest.fixture(scope="module")
def default_steps_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The default step sizes: with nothing decoding, one step prefills up to 2,048 tokens."""
    running = start_server(
        tmp_path_factory.mktemp("keepalive-steps"),
        "--context-length", "8192",
        "--ping-interval-s", str(PING_S),
        "--prefix-cache-mb", "0",
    )  # fmt: skip
    yield running
    stop_server(running)


def test_a_prompt_prefilled_in_one_step_still_gets_keepalives(
    default_steps_server: RunningServer,
) -> None:
    """Keep-alives go out between the prefill's forward passes, not only between engine steps."""
    recorded = Recorded()
    stream = openai_client(default_steps_server, recorded).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": LONG_PROMPT + " " + LONG_PROMPT}],
        max_tokens=3,
        stream=True,
    )
    assert [c for chunk in stream for c in chunk.choices if c.finish_reason]
    assert keepalives_before_text(bytes(recorded.raw)) >= 1, bytes(recorded.raw)[:2000]
