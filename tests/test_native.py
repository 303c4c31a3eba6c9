"""mlxgate._native: the golden wire transcripts cargo test also checks; Reader under asyncio."""

from __future__ import annotations

import array
import asyncio
import contextvars
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVarTuple

import pytest

from mlxgate._native import (
    Dialect,
    ErrorKind,
    FinishReason,
    Markup,
    NativeError,
    Reader,
    Reply,
    Router,
    StreamSpec,
    Vocab,
)
from mlxgate.api.reader import chunks
from support.sse import without_id

FIXTURES = Path(__file__).resolve().parent / "fixtures"
INPUTS = sorted(p for p in FIXTURES.glob("*.json") if not p.name.endswith(".body.json"))
UNLIMITED = 2**64 - 1  # max_tokens when a fixture gives none, as in rust/tests/golden.rs

END_TURN, MAX_TOKENS = FinishReason.END_TURN, FinishReason.MAX_TOKENS
STOP_SEQUENCE, TOOL_USE = FinishReason.STOP_SEQUENCE, FinishReason.TOOL_USE
CANCELLED = FinishReason.CANCELLED


def sse_frames(sse: str) -> list[str]:
    """The frames of an SSE body, without their `id:` lines."""
    return [without_id(frame) for frame in sse.split("\n\n") if frame]


def vocab_from(spec: dict[str, Any]) -> Vocab:
    trim = spec.get("trim_leading_space", False)
    if spec["kind"] == "raw":  # test-only: each token string is the token's UTF-8 bytes
        tokens = [t.encode() for t in spec["tokens"]]
        return Vocab.from_token_bytes(tokens, spec["special_ids"], trim_leading_space=trim)
    return Vocab.from_token_strings(
        spec["tokens"], spec["kind"], spec["special_ids"], trim_leading_space=trim
    )


def open_from(router: Router, spec: dict[str, Any]) -> Reader:
    markup = None
    if "markup" in spec:
        think = spec["markup"].get("think")
        markup = Markup(
            think=tuple(think) if think else None, tool_call=spec["markup"].get("tool_call")
        )
    common: dict[str, Any] = {
        "model": spec["model"],
        "stream": spec.get("stream", True),
        "stop_sequences": spec.get("stop_sequences", []),
        "reply": Reply(
            markup=markup, prefill=spec.get("prefill", ""), eos_ids=spec.get("eos_ids", [])
        ),
    }
    dialect = spec.get("dialect", "anthropic")
    if dialect == "responses":
        stream_spec = StreamSpec.responses(
            response_id=spec["response_id"],
            created_at=spec["created_at"],
            echo=spec.get("echo", ""),
            reasoning_summary=spec.get("reasoning_summary", False),
            encrypted_reasoning=spec.get("encrypted_reasoning", False),
            namespaced=[tuple(t) for t in spec.get("namespaced", [])],
            **common,
        )
    elif dialect == "openai":
        stream_spec = StreamSpec.openai(
            completion_id=spec["completion_id"],
            created=spec["created"],
            include_usage=spec.get("include_usage", False),
            kind=spec.get("kind", "chat"),
            **common,
        )
    else:
        stream_spec = StreamSpec.anthropic(message_id=spec["message_id"], **common)
    return router.open(
        spec["stream_id"],
        stream_spec,
        prompt_tokens=spec.get("prompt_tokens", 0),
        cached_tokens=spec.get("cached_tokens", 0),
        max_tokens=spec.get("max_tokens", UNLIMITED),
    )


def ended_as(sid: int, step: dict[str, Any]) -> list[tuple[int, FinishReason]]:
    """What router.step reports for a fixture's token step: its `ends` reason, if any."""
    return [(sid, getattr(FinishReason, step["ends"].upper()))] if "ends" in step else []


def golden_path(input_path: Path, fixture: dict[str, Any]) -> Path:
    suffix = ".sse" if fixture["open"].get("stream", True) else ".body.json"
    return input_path.with_name(input_path.stem + suffix)


def test_fixtures_present() -> None:
    names = {p.stem for p in INPUTS}
    assert {
        "anthropic_text",
        "anthropic_stop_sequence",
        "anthropic_max_tokens",
        "anthropic_error",
        "anthropic_text_nonstream",
        "anthropic_tool_use",
        "anthropic_tool_use_nonstream",
        "anthropic_thinking",
        "openai_text",
        "openai_text_usage",
        "openai_text_nonstream",
        "openai_tool_calls",
        "openai_tool_calls_nonstream",
        "openai_error",
        "openai_completion",
    } <= names


@pytest.mark.parametrize("input_path", INPUTS, ids=lambda p: p.stem)
def test_golden_transcript(input_path: Path) -> None:
    fixture = json.loads(input_path.read_text(encoding="utf-8"))
    router = Router(vocab_from(fixture["vocab"]))
    reader = open_from(router, fixture["open"])
    sid = fixture["open"]["stream_id"]
    out = bytearray()

    def drain() -> None:
        data = reader.take()
        if data is not None:
            out.extend(data)

    drain()
    for i, step in enumerate(fixture["steps"]):
        if "fail" in step:
            kind = getattr(ErrorKind, step["fail"]["kind"].upper())
            router.fail(sid, kind, step["fail"]["message"])
        else:
            assert router.step([sid], [step["token"]]) == ended_as(sid, step), f"step {i}"
        drain()
    assert len(router) == 0
    assert reader.take() is None
    assert bytes(out) == golden_path(input_path, fixture).read_bytes()


def dialect_of(fixture: dict[str, Any]) -> str:
    return str(fixture["open"].get("dialect", "anthropic"))


def test_goldens_are_valid_anthropic_sse() -> None:
    order = {"message_start": 0, "ping": 1, "content_block_start": 2, "content_block_delta": 3}
    for input_path in INPUTS:
        fixture = json.loads(input_path.read_text(encoding="utf-8"))
        if dialect_of(fixture) != "anthropic":
            continue
        golden = golden_path(input_path, fixture).read_text(encoding="utf-8")
        if not fixture["open"].get("stream", True):
            body = json.loads(golden)
            assert list(body)[:2] == ["id", "type"]
            for block in body.get("content", []):
                if block["type"] == "tool_use":
                    assert block["id"].startswith("toolu_") and isinstance(block["input"], dict)
            continue
        assert golden.endswith("\n\n")
        events = []
        open_blocks: dict[int, dict[str, Any]] = {}
        for frame in sse_frames(golden):
            event_line, data_line = frame.split("\n")
            event = event_line.removeprefix("event: ")
            data = json.loads(data_line.removeprefix("data: "))
            assert next(iter(data)) == "type" and data["type"] == event
            events.append(event)
            if event == "content_block_start":
                open_blocks[data["index"]] = {**data["content_block"], "json": ""}
            elif event == "content_block_delta":
                block = open_blocks[data["index"]]  # every delta has its start
                if data["delta"]["type"] == "input_json_delta":
                    assert block["type"] == "tool_use"
                    block["json"] += data["delta"]["partial_json"]
            elif event == "content_block_stop":
                block = open_blocks.pop(data["index"])
                if block["type"] == "tool_use":
                    assert block["input"] == {} and block["id"].startswith("toolu_")
                    assert isinstance(json.loads(block["json"]), dict)
        assert events[:2] == ["message_start", "ping"]
        assert [order.get(e, 9) for e in events[:4]] == sorted(order.get(e, 9) for e in events[:4])
        assert events[-1] in ("message_stop", "error")


def test_goldens_are_valid_openai_sse() -> None:
    for input_path in INPUTS:
        fixture = json.loads(input_path.read_text(encoding="utf-8"))
        if dialect_of(fixture) != "openai":
            continue
        golden = golden_path(input_path, fixture).read_text(encoding="utf-8")
        chat = fixture["open"].get("kind", "chat") == "chat"
        if not fixture["open"].get("stream", True):
            body = json.loads(golden)
            assert body["object"] == ("chat.completion" if chat else "text_completion")
            for call in body["choices"][0].get("message", {}).get("tool_calls", []):
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
            continue
        frames = [*sse_frames(golden), ""]
        assert frames[-2:] == ["data: [DONE]", ""]
        arguments: dict[int, str] = {}
        for frame in frames[:-2]:
            assert frame.startswith("data: ") and "\n" not in frame
            data = json.loads(frame.removeprefix("data: "))
            if "error" in data:
                assert set(data["error"]) == {"message", "type", "param", "code"}
                continue
            assert data["object"] == ("chat.completion.chunk" if chat else "text_completion")
            assert ("usage" in data) == fixture["open"].get("include_usage", False)
            for choice in data["choices"]:
                for call in choice.get("delta", {}).get("tool_calls", []):
                    arguments[call["index"]] = (
                        arguments.get(call["index"], "") + call["function"]["arguments"]
                    )
        for text in arguments.values():
            assert isinstance(json.loads(text), dict)


def text_vocab() -> Vocab:
    return Vocab.from_token_bytes(
        [b"<eos>", b"Hi", b" there", "😀".encode()[:2], "😀".encode()[2:], b"END"], [0]
    )


def reply_of(kw: dict[str, Any]) -> Reply:
    """The `Reply` in `kw`'s markup, prefill and tools (they are taken out); token 0 ends it."""
    return Reply(
        markup=kw.pop("markup", None),
        prefill=kw.pop("prefill", ""),
        eos_ids=[0],
        tools=kw.pop("tools", []),
    )


def open_text(router: Router, sid: int, *, max_tokens: int = UNLIMITED, **kw: Any) -> Reader:
    """An Anthropic stream over text_vocab(): token 0 (`<eos>`) ends the turn."""
    reply = reply_of(kw)
    spec = StreamSpec.anthropic(model="m", message_id=f"msg_{sid}", **kw, reply=reply)
    return router.open(sid, spec, prompt_tokens=1, max_tokens=max_tokens)


def open_openai(router: Router, sid: int, *, max_tokens: int = UNLIMITED, **kw: Any) -> Reader:
    reply = reply_of(kw)
    spec = StreamSpec.openai(model="m", completion_id="c", created=1, **kw, reply=reply)
    return router.open(sid, spec, prompt_tokens=1, max_tokens=max_tokens)


def test_vocab_kinds_and_decode() -> None:
    v = Vocab.from_token_strings(["<s>", "▁Hi", "<0xE4>", "<0xBD>", "<0xA0>"], "sentencepiece", [0])
    assert len(v) == 5
    assert v.decode([0, 1, 2, 3, 4]) == " Hi你"
    v = Vocab.from_token_strings(["Hi", "Ġthere", "Ċ"], "byte_level", [])
    assert v.decode([0, 1, 2]) == "Hi there\n"
    assert text_vocab().decode([1, 3, 4, 0, 99]) == "Hi😀"
    with pytest.raises(NativeError, match="unknown vocab kind"):
        Vocab.from_token_strings(["a"], "bpe", [])  # type: ignore[arg-type]
    with pytest.raises(NativeError, match="out of range"):
        Vocab.from_token_bytes([b"a"], [5])


def test_errors_are_native_value_errors() -> None:
    assert issubclass(NativeError, ValueError)
    assert NativeError.__module__ == "mlxgate._native"
    router = Router(text_vocab())
    _reader = open_text(router, 1)
    with pytest.raises(NativeError, match="already open"):
        open_text(router, 1)
    with pytest.raises(
        NativeError, match="step arguments differ in length: 1 stream ids, 2 token ids"
    ):
        router.step([1], [1, 2])
    with pytest.raises(TypeError):
        router.step("ab", [1])  # type: ignore[arg-type]
    with pytest.raises(NativeError, match="unknown prefix cache tier"):
        router.cached(1, 5, "swap")
    with pytest.raises(NativeError, match="unknown drafter"):
        router.guessed([1], [2], [1], "oracle")
    with pytest.raises(NativeError, match="guessed arguments differ in length"):
        router.guessed([1, 2], [2], [1, 1], "prompt-lookup")


def test_a_reader_says_how_many_guesses_its_verify_passes_kept() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1)
    assert reader.guesses == ("", 0, 0)
    router.guessed([1, 7], [4, 4], [3, 0], "prompt-lookup")  # 7: not open, ignored
    router.guessed([1], [2], [2], "prompt-lookup")
    assert reader.guesses == ("prompt-lookup", 6, 5)


def test_a_reader_says_where_its_cached_tokens_came_from() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1)
    assert (reader.prompt_tokens, reader.cached_from) == ((1, 0), "")
    router.cached(1, 1, "in-flight")
    assert (reader.prompt_tokens, reader.cached_from) == ((1, 1), "in-flight")
    spec = StreamSpec.anthropic(model="m", message_id="msg_2", stream=False, stop_sequences=[])
    opened = router.open(
        2, spec, prompt_tokens=9, cached_tokens=8, cached_from="disk", max_tokens=4
    )
    assert (opened.prompt_tokens, opened.cached_from) == ((9, 8), "disk")


def test_error_kinds_and_dialect_replies() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1)
    with pytest.raises(TypeError):
        router.fail(1, "overloaded_error", "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        router.fail(1, 6, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Dialect.OPENAI.error_status(Dialect.ANTHROPIC)  # type: ignore[arg-type]
    assert len(router) == 1 and reader.status == 200, "a rejected fail changes nothing"
    auth = ErrorKind.AUTHENTICATION
    assert Dialect.OPENAI.error_status(auth) == Dialect.ANTHROPIC.error_status(auth) == 401
    assert json.loads(Dialect.ANTHROPIC.error_reply(auth, "bad key")) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "bad key"},
    }
    assert json.loads(Dialect.OPENAI.error_reply(auth, "bad key", code="invalid_api_key")) == {
        "error": {
            "message": "bad key",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def test_step_accepts_tuples_and_int_buffers() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 5)
    reader.take()
    assert router.step((5,), (1,)) == []
    assert router.step(array.array("q", [5]), array.array("i", [2])) == []
    import numpy as np

    assert router.step(np.array([5], np.uint64), np.array([0], np.int32)) == [(5, END_TURN)]
    data = reader.take()
    assert data is not None and b'"text":"Hi"' in data and b'"text":" there"' in data
    assert b'"output_tokens":3' in data
    other = open_text(router, 6)
    assert router.step(bytes([6, 6]), np.array([1, 0], np.int8)) == [(6, END_TURN)]
    assert b'"text":"Hi"' in (other.take() or b"")
    with pytest.raises(OverflowError):
        router.step(array.array("q", [-1]), [1])


def test_unknown_ids_ignored_and_len() -> None:
    router = Router(text_vocab())
    readers = [open_text(router, 1), open_text(router, 2)]
    assert len(router) == 2
    assert router.step([3, 1], [1, 0]) == [(1, END_TURN)]
    assert len(router) == 1
    router.fail(99, ErrorKind.INTERNAL, "x")
    router.close(99)
    router.ping(99)
    router.close(2)
    assert len(router) == 0
    assert [r.take() is not None for r in readers] == [True, True], "unread frames survive close"


def test_dropping_reader_cancels() -> None:
    router = Router(text_vocab())
    kept = open_text(router, 1)
    open_text(router, 2)  # reference dropped at once
    assert router.cancelled() == [2]
    assert router.step([1, 2], [1, 1]) == []
    del kept
    assert router.step([1], [1]) == [(1, CANCELLED)]
    assert len(router) == 0


def test_stop_sequence_reported_and_not_leaked() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1, stop_sequences=["thereEN", "zzz"])
    assert router.step([1], [1]) == []
    assert router.step([1], [2]) == []
    assert router.step([1], [5]) == [(1, STOP_SEQUENCE)]
    data = reader.take()
    assert data is not None
    assert b"there" not in data.split(b"message_delta")[0]
    assert b'"stop_reason":"stop_sequence","stop_sequence":"thereEN"' in data
    assert reader.take() is None


def test_non_streaming_body_only_at_end_then_eof() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1, stream=False)
    assert reader.take() == b""
    assert router.step([1], [1]) == []
    assert reader.take() == b""
    assert router.step([1], [0]) == [(1, END_TURN)]
    body = json.loads(reader.take() or b"")
    assert body["content"] == [{"type": "text", "text": "Hi"}]
    assert body["usage"]["output_tokens"] == 2
    assert reader.take() is None

    reader = open_text(router, 2, stream=False)
    router.fail(2, ErrorKind.OVERLOADED, "Overloaded")
    assert json.loads(reader.take() or b"") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert reader.take() is None


@pytest.mark.parametrize(("dialect", "overloaded"), [("anthropic", 529), ("openai", 503)])
def test_non_streaming_status(dialect: str, overloaded: int) -> None:
    router = Router(text_vocab())
    open_stream = open_openai if dialect == "openai" else open_text
    done = open_stream(router, 1, stream=False)
    failed = open_stream(router, 2, stream=False)
    assert (done.status, failed.status) == (200, 200), "200 while running"
    assert router.step([1, 2], [1, 1]) == []
    router.fail(2, ErrorKind.OVERLOADED, "Overloaded")
    assert router.step([1, 2], [0, 0]) == [(1, END_TURN)], "a failed stream is gone"
    assert (done.status, failed.status) == (200, overloaded)
    assert overloaded == getattr(Dialect, dialect.upper()).error_status(ErrorKind.OVERLOADED)
    assert "error" not in json.loads(done.take() or b"")
    assert "Overloaded" in json.loads(failed.take() or b"")["error"]["message"]
    assert (done.take(), failed.take()) == (None, None)
    assert (done.status, failed.status) == (200, overloaded), "kept after end of stream"


class Woken:
    """A wake_all that records each call's waiters."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, waiters: list[Any]) -> None:
        self.calls.append(waiters)


def test_park_semantics() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1)
    woken = Woken()
    assert reader.park("early", woken) is False, "message_start is pending"
    assert reader.unread_bytes > 0
    assert reader.take()
    assert reader.unread_bytes == 0
    assert reader.park("first", woken) is True
    assert reader.park("second", woken) is True
    router.step([1], [3])  # half an emoji: nothing to send, no wake
    assert woken.calls == []
    router.step([1], [4])
    assert woken.calls == [["second"]]
    router.step([1], [1])
    assert woken.calls == [["second"]], "woken once, then cleared"
    assert reader.take()
    assert reader.park("close", woken) is True
    assert router.step([1], [0]) == [(1, END_TURN)]
    assert woken.calls == [["second"], ["close"]]
    assert reader.park("never", woken) is False
    assert reader.take()
    assert reader.take() is None
    assert reader.park("never", woken) is False
    with pytest.raises(TypeError):
        reader.park("waiter", 3)  # type: ignore[arg-type]


def test_one_step_wakes_each_wake_all_once() -> None:
    router = Router(text_vocab())
    readers = [open_text(router, sid) for sid in range(1, 9)]
    loop_a, loop_b = Woken(), Woken()
    for sid, reader in enumerate(readers, start=1):
        reader.take()
        assert reader.park(f"w{sid}", loop_a if sid <= 6 else loop_b)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert router.step(ids, [1] * 8) == []
    assert loop_a.calls == [["w1", "w2", "w3", "w4", "w5", "w6"]]
    assert loop_b.calls == [["w7", "w8"]]
    assert router.step(ids, [1] * 8) == []
    assert len(loop_a.calls) == 1 and len(loop_b.calls) == 1, "nobody parked again"


def test_fail_close_ping_and_cancel_wake_their_reader() -> None:
    router = Router(text_vocab())
    readers = {sid: open_text(router, sid) for sid in (1, 2, 3, 4)}
    woken = Woken()
    for sid, reader in readers.items():
        reader.take()
        assert reader.park(sid, woken)
    router.ping(1)
    router.fail(2, ErrorKind.INTERNAL, "boom")
    router.close(3)
    readers[4].cancel()
    assert woken.calls == [[1], [2], [3], [4]]
    router.ping(1)
    router.close(3)
    assert len(woken.calls) == 4, "woken once each"


def test_failing_wake_all_does_not_break_step(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    router = Router(text_vocab())
    failing, working = open_text(router, 1), open_text(router, 2)
    failing.take()
    working.take()

    def boom(waiters: list[Any]) -> None:
        raise RuntimeError("loop closed")

    woken = Woken()
    assert failing.park("f", boom)
    assert working.park("w", woken)
    assert router.step([1, 2], [1, 1]) == []
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    assert woken.calls == [["w"]]
    assert failing.take()


def test_cancel_before_first_token_and_mid_stream() -> None:
    router = Router(text_vocab())
    prefilling = open_text(router, 1)
    running = open_text(router, 2)
    other = open_text(router, 3)
    woken = Woken()
    running.take()
    assert running.park(2, woken)
    prefilling.cancel()
    assert router.cancelled() == [1]
    assert router.cancelled() == []
    assert prefilling.take() is None
    running.cancel()
    assert woken.calls == [[2]], "a parked reader is woken by cancel"
    assert running.take() is None
    assert router.step([2, 3], [1, 1]) == [(2, CANCELLED)]
    assert len(router) == 1
    other.cancel()
    other.cancel()
    assert router.step([], []) == [(3, CANCELLED)]
    assert len(router) == 0


def test_over_bound_and_unread_bytes() -> None:
    router = Router(text_vocab(), max_unread_bytes=600)
    fast = open_text(router, 1)
    slow = open_text(router, 2)
    for _ in range(4):
        assert router.step([1, 2], [1, 1]) == []
        fast.take()
    assert router.over_bound() == [2]
    assert slow.unread_bytes > 600
    slow.take()
    assert router.over_bound() == []


def test_ping_keepalive() -> None:
    router = Router(text_vocab())
    reader = open_text(router, 1)
    reader.take()
    router.ping(1)
    assert reader.take() == b'id: 3\nevent: ping\ndata: {"type":"ping"}\n\n'
    quiet = open_text(router, 2, stream=False)
    router.ping(2)
    assert quiet.take() == b""


async def read_stream(reader: Reader) -> bytes:
    return b"".join([chunk async for chunk in chunks(reader)])


Ts = TypeVarTuple("Ts")


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(
        self,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_chunks_one_threadsafe_call_per_step() -> None:
    """Readers parked by mlxgate.api.reader share their loop's wake_all: one wake per step."""
    router = Router(text_vocab())
    ids = list(range(1, 33))
    readers: list[Reader] = []

    async def settle() -> None:
        for _ in range(5):  # woken tasks take their frames and park again
            await asyncio.sleep(0)

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        tasks = [asyncio.create_task(read_stream(reader)) for reader in readers]
        await settle()
        assert router.step(ids, [1] * 32) == []
        assert loop.threadsafe_calls == 1
        await settle()
        assert router.step(ids, [0] * 32) == [(sid, END_TURN) for sid in ids]
        assert loop.threadsafe_calls == 2
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    for _ in range(2):  # a second loop gets its own wake_all
        readers = [open_text(router, sid) for sid in ids]
        with asyncio.Runner(loop_factory=CountingLoop) as runner:
            received = runner.run(main())
        assert all(b"message_stop" in sse for sse in received)


def test_threaded_producer_matches_golden() -> None:
    input_path = FIXTURES / "anthropic_text.json"
    fixture = json.loads(input_path.read_text(encoding="utf-8"))
    router = Router(vocab_from(fixture["vocab"]))
    reader = open_from(router, fixture["open"])
    sid = fixture["open"]["stream_id"]
    ended: list[tuple[int, FinishReason]] = []

    def produce() -> None:
        for step in fixture["steps"]:
            time.sleep(0.002)
            ended.extend(router.step([sid], [step["token"]]))

    async def main() -> bytes:
        producer = threading.Thread(target=produce)
        producer.start()
        try:
            return await asyncio.wait_for(read_stream(reader), 10)
        finally:
            producer.join()

    assert asyncio.run(main()) == (FIXTURES / "anthropic_text.sse").read_bytes()
    assert ended == [e for step in fixture["steps"] for e in ended_as(sid, step)]


def test_many_streams_no_lost_wakeups() -> None:
    """A batch of streams stepped from an engine thread while asyncio reads them all."""
    vocab = Vocab.from_token_bytes([b"<eos>", *[f"t{i} ".encode() for i in range(1, 50)]], [0])
    router = Router(vocab)
    n_streams, n_steps = 64, 150
    readers = {sid: open_text(router, sid) for sid in range(n_streams)}
    cancel_sid = 7
    ended: dict[int, list[FinishReason]] = {}

    def produce() -> None:
        live = set(range(n_streams))
        for step in range(n_steps):
            ids = sorted(live)
            last = step == n_steps - 1  # the last token is <eos>: counted, not rendered
            tokens = [0 if last else 1 + (sid + step) % 49 for sid in ids]
            for sid, reason in router.step(ids, tokens):
                ended.setdefault(sid, []).append(reason)
                live.discard(sid)
            if step % 10 == 0:
                time.sleep(0.001)

    async def main() -> dict[int, bytes]:
        producer = threading.Thread(target=produce)
        tasks = {sid: asyncio.create_task(read_stream(r)) for sid, r in readers.items()}
        producer.start()
        await asyncio.sleep(0.01)
        readers[cancel_sid].cancel()
        try:
            done = await asyncio.wait_for(asyncio.gather(*tasks.values()), 20)
        finally:
            producer.join()
        return dict(zip(tasks, done, strict=True))

    results = asyncio.run(main())
    assert len(router) == 0
    # The cancel may land after the last step (the stream has then already ended).
    assert ended.pop(cancel_sid) in ([CANCELLED], [END_TURN])
    assert ended == {sid: [END_TURN] for sid in range(n_streams) if sid != cancel_sid}
    for sid, data in results.items():
        if sid == cancel_sid:
            continue
        text = "".join(
            json.loads(line[6:])["delta"]["text"]
            for line in data.decode().split("\n")
            if line.startswith("data: ") and '"text_delta"' in line
        )
        expected = "".join(f"t{1 + (sid + step) % 49} " for step in range(n_steps - 1))
        assert text == expected, sid
        assert data.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        assert f'"output_tokens":{n_steps}}}'.encode() in data


# Markup: thinking and tool calls, end to end through the router.

HERMES = Markup(tool_call="hermes")
QWEN3 = Markup(think=("<think>", "</think>"), tool_call="hermes")


# How each dialect words a FinishReason on the wire.
WIRE_REASON = {
    "anthropic": {
        END_TURN: b'"stop_reason":"end_turn"',
        MAX_TOKENS: b'"stop_reason":"max_tokens"',
        STOP_SEQUENCE: b'"stop_reason":"stop_sequence"',
        TOOL_USE: b'"stop_reason":"tool_use"',
    },
    "openai": {
        END_TURN: b'"finish_reason":"stop"',
        MAX_TOKENS: b'"finish_reason":"length"',
        STOP_SEQUENCE: b'"finish_reason":"stop"',
        TOOL_USE: b'"finish_reason":"tool_calls"',
    },
}


def run_pieces(
    pieces: list[bytes], *, dialect: str = "anthropic", max_tokens: bool = False, **kw: Any
) -> bytes:
    """Each piece is one token; the stream ends with EOS after the last piece, or (max_tokens)
    at the last piece, unless the router ends it earlier. Checks the router reports the one end
    the wire shows."""
    router = Router(Vocab.from_token_bytes([b"<eos>", *pieces], [0]))
    n = len(pieces)
    reply = reply_of(kw)
    if dialect == "openai":
        spec = StreamSpec.openai(
            model="m", completion_id="chatcmpl-1", created=1, **kw, reply=reply
        )
    else:
        spec = StreamSpec.anthropic(model="m", message_id="msg_1", **kw, reply=reply)
    reader = router.open(1, spec, prompt_tokens=1, max_tokens=n if max_tokens else UNLIMITED)
    out = bytearray(reader.take() or b"")
    ended: list[tuple[int, FinishReason]] = []
    for i in range(n):
        ended = router.step([1], [i + 1])
        out += reader.take() or b""
        if ended:
            break
    if not ended:
        assert not max_tokens
        ended = router.step([1], [0])
    out += reader.take() or b""
    assert reader.take() is None
    assert len(router) == 0
    [(sid, reason)] = ended
    assert sid == 1 and WIRE_REASON[dialect][reason] in out
    return bytes(out)


def anthropic_blocks(sse: bytes) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rebuilds content blocks from Anthropic SSE, checking event structure; returns the blocks
    and the message_delta."""
    blocks: list[dict[str, Any]] = []
    delta: dict[str, Any] = {}
    open_index = None
    for frame in sse_frames(sse.decode()):
        _event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        if data["type"] == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "json": ""})
        elif data["type"] == "content_block_delta":
            assert data["index"] == open_index
            d, block = data["delta"], blocks[-1]
            key = {"text_delta": "text", "thinking_delta": "thinking"}.get(d["type"])
            if key:
                block[key] += d[key]
            elif d["type"] == "input_json_delta":
                block["json"] += d["partial_json"]
        elif data["type"] == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif data["type"] == "message_delta":
            delta = data["delta"]
    assert open_index is None
    return blocks, delta


def split_bytes(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


ARGS = '{"command": "echo \\"hi\\" \\\\ caf\\u00e9 é 😀", "n": [1, -2.5e3, true, null]}'
CALL = f'<tool_call>\n{{"name": "Bash", "arguments": {ARGS}}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
def test_tool_call_split_anywhere_streams_exact_arguments(size: int) -> None:
    text = "Checking.\n\n" + CALL
    sse = run_pieces(split_bytes(text.encode(), size), markup=HERMES)
    blocks, delta = anthropic_blocks(sse)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[0]["text"] == "Checking."
    assert blocks[1]["name"] == "Bash" and blocks[1]["input"] == {}
    assert blocks[1]["json"] == ARGS, "escapes and UTF-8 preserved exactly"
    assert json.loads(blocks[1]["json"])["command"] == 'echo "hi" \\ café é 😀'
    assert delta["stop_reason"] == "tool_use"
    if size <= 3:
        assert sse.count(b"input_json_delta") > 10, "arguments stream as tokens arrive"
    assert b"<tool_call>" not in sse and b"</tool_call>" not in sse


def test_two_tool_calls_openai_indices_and_ids() -> None:
    second = '<tool_call>\n{"arguments": {"path": "a"}, "name": "Read"}\n</tool_call>'
    sse = run_pieces(
        split_bytes((CALL + "\n" + second).encode(), 4), dialect="openai", markup=HERMES
    )
    frames = [json.loads(f[6:]) for f in sse_frames(sse.decode()) if f.startswith("data: {")]
    calls: dict[int, dict[str, str]] = {}
    for frame in frames:
        for call in frame["choices"][0]["delta"].get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"arguments": ""})
            if "id" in call:
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                entry.update(id=call["id"], name=call["function"]["name"])
            entry["arguments"] += call["function"]["arguments"]
    assert [calls[i]["name"] for i in (0, 1)] == ["Bash", "Read"]
    assert calls[0]["arguments"] == ARGS
    assert calls[1]["arguments"] == '{"path": "a"}', "name after arguments: buffered"
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert sse.endswith(b"data: [DONE]\n\n")


def test_malformed_tool_call_falls_back_to_text() -> None:
    text = 'Try <tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>'
    blocks, delta = anthropic_blocks(run_pieces(split_bytes(text.encode(), 3), markup=HERMES))
    assert blocks == [{"type": "text", "text": text, "json": ""}]
    assert delta["stop_reason"] == "end_turn"


def test_thinking_tags_split_across_tokens() -> None:
    pieces = [b"<th", b"ink>", b"\nlet me ", b"see <", b"/thi", b"nk>\n\n", b"Answer", b" <b>"]
    blocks, _ = anthropic_blocks(run_pieces(pieces, markup=QWEN3))
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in blocks] == [
        ("thinking", "let me see"),
        ("text", "Answer <b>"),
    ]
    assert blocks[0]["signature"] == ""


def test_stop_sequences_apply_to_visible_text_only() -> None:
    pieces = [
        b"<think>ls</think>",
        b'<tool_call>{"name": "ls", "arguments": {"a": "ls"}}',
        b"</tool_call>",
    ]
    sse = run_pieces([*pieces, b"ok ls more"], markup=QWEN3, stop_sequences=["ls"])
    blocks, delta = anthropic_blocks(sse)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "text"]
    assert blocks[2]["text"] == "ok "
    assert delta["stop_reason"] == "tool_use", "a complete call wins over the stop sequence"
    blocks, delta = anthropic_blocks(run_pieces([b"say ls"], markup=QWEN3, stop_sequences=["ls"]))
    assert (blocks[0]["text"], delta) == (
        "say ",
        {"stop_reason": "stop_sequence", "stop_sequence": "ls"},
    )


def test_prefill_forced_tool_call_starts_at_open() -> None:
    router = Router(Vocab.from_token_bytes([b"<eos>", b'{"command": "ls"}', b"}"], [0]))
    prefill = '<tool_call>\n{"name": "Bash", "arguments": '
    spec = StreamSpec.anthropic(
        model="m", message_id="msg_1", reply=Reply(markup=HERMES, prefill=prefill, eos_ids=[0])
    )
    reader = router.open(1, spec, prompt_tokens=1, max_tokens=UNLIMITED)
    start = reader.take() or b""
    assert b'"content_block_start","index":0,"content_block":{"type":"tool_use"' in start
    assert router.step([1, 1, 1], [1, 2, 0]) == [(1, TOOL_USE)]
    blocks, delta = anthropic_blocks(start + (reader.take() or b""))
    assert blocks[0]["json"] == '{"command": "ls"}' and delta["stop_reason"] == "tool_use"

    reader = open_openai(router, 2, markup=QWEN3, prefill="<think>\n", stream=False)
    assert router.step([2, 2], [2, 0]) == [(2, END_TURN)]
    message = json.loads(reader.take() or b"")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "", "reasoning_content": "}"}


def test_max_tokens_inside_tool_call_keeps_json_valid() -> None:
    text = '<tool_call>{"name": "Bash", "arguments": {"command": "rm -rf /tmp/x'
    blocks, delta = anthropic_blocks(
        run_pieces(split_bytes(text.encode(), 6), markup=HERMES, max_tokens=True)
    )
    assert json.loads(blocks[0]["json"]) == {"command": "rm -rf /tmp/x"}
    assert delta["stop_reason"] == "max_tokens", "a cut-off call is not reported as tool_use"


def test_markup_values_and_errors() -> None:
    m = Markup(think=("<think>", "</think>"), tool_call="mistral")
    assert (m.think, m.tool_call) == (("<think>", "</think>"), "mistral")
    assert repr(Markup()) == "Markup(think=None, tool_call=None)"
    with pytest.raises(NativeError, match="unknown tool call format"):
        Markup(tool_call="xml")  # type: ignore[arg-type]
    with pytest.raises(NativeError, match="must not be empty"):
        Markup(think=("", "</think>"))
    with pytest.raises(NativeError, match="unknown completion kind"):
        StreamSpec.openai(model="m", completion_id="c", created=1, kind="x")  # type: ignore[arg-type]


def test_openai_fail_and_ping() -> None:
    router = Router(text_vocab())
    reader = open_openai(router, 1)
    reader.take()
    router.ping(1)
    ping = json.loads((reader.take() or b"").removeprefix(b"id: 2\ndata: "))
    assert ping["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
    router.fail(1, ErrorKind.INVALID_REQUEST, "bad")
    assert reader.take() == (
        b'id: 3\ndata: {"error":{"message":"bad","type":"invalid_request_error","param":null,'
        b'"code":null}}\n\nid: 4\ndata: [DONE]\n\n'
    )
    assert reader.take() is None
    reader = open_openai(router, 2, stream=False)
    router.fail(2, ErrorKind.INTERNAL, "boom")
    assert json.loads(reader.take() or b"")["error"]["type"] == "server_error"
    assert reader.status == 500


def test_completion_kind_ignores_markup() -> None:
    sse = run_pieces(
        [b"<think>x</think>", b"<tool_call>{}"], dialect="openai", kind="completion", markup=QWEN3
    )
    texts = [
        json.loads(f[6:])["choices"][0]["text"]
        for f in sse_frames(sse.decode())
        if f.startswith("data: {")
    ]
    assert "".join(texts) == "<think>x</think><tool_call>{}"


# Issue 13 formats: schema-typed XML parameters, and tags that are special tokens.

BASH_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "command": {"type": "string"},
            "timeout": {"type": "integer"},
            "background": {"type": "boolean"},
            "env": {"type": "object"},
        },
    }
)
QWEN3_CODER = Markup(think=("<think>", "</think>"), tool_call="qwen3_coder")
QWEN3_CODER_CALLS = (
    "Running it.\n<tool_call>\n<function=Bash>\n<parameter=command>\n"
    'cat <a> </b> "x" é😀\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n'
    '<parameter=background>\ntrue\n</parameter>\n<parameter=env>\n{"A": [1, "b"]}\n'
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=Bash>\n"
    "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
def test_qwen3_coder_parameters_typed_by_tool_schema(size: int, dialect: str) -> None:
    sse = run_pieces(
        split_bytes(QWEN3_CODER_CALLS.encode(), size),
        dialect=dialect,
        markup=QWEN3_CODER,
        tools=[("Bash", BASH_SCHEMA), ("Read", "{}")],
    )
    want = [
        {
            "command": 'cat <a> </b> "x" é😀',
            "timeout": 30,
            "background": True,
            "env": {"A": [1, "b"]},
        },
        {"command": "ls"},
    ]
    if dialect == "openai":
        calls: dict[int, str] = {}
        for line in sse.decode().splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for call in choice["delta"].get("tool_calls") or []:
                        args = call.get("function", {}).get("arguments", "")
                        calls[call["index"]] = calls.get(call["index"], "") + args
        assert [json.loads(calls[i]) for i in sorted(calls)] == want
        return
    blocks, delta = anthropic_blocks(sse)
    assert blocks[0] == {"type": "text", "text": "Running it.", "json": ""}
    assert [b["name"] for b in blocks[1:]] == ["Bash", "Bash"]
    assert [json.loads(b["json"]) for b in blocks[1:]] == want
    assert delta["stop_reason"] == "tool_use"


def test_xml_call_cut_by_max_tokens_is_closed_validly() -> None:
    text = (
        "<tool_call>\n<function=Bash>\n<parameter=timeout>\n3\n</parameter>\n"
        "<parameter=command>\nec"
    )
    blocks, delta = anthropic_blocks(
        run_pieces(
            split_bytes(text.encode(), 5),
            markup=QWEN3_CODER,
            tools=[("Bash", BASH_SCHEMA)],
            max_tokens=True,
        )
    )
    assert [(b["type"], json.loads(b["json"])) for b in blocks] == [
        ("tool_use", {"timeout": 3, "command": "ec"})
    ]
    assert delta["stop_reason"] == "max_tokens"


def special_vocab(texts: list[str], special: list[str]) -> tuple[Vocab, dict[str, int]]:
    """A vocab of `texts` (id 0 is `<eos>`); those in `special` are special tokens."""
    tokens = ["<eos>", *texts]
    ids = {t: i for i, t in enumerate(tokens)}
    vocab = Vocab.from_token_bytes([t.encode() for t in tokens], [0, *(ids[t] for t in special)])
    return vocab, ids


def test_harmony_tags_as_special_tokens_reach_the_parser() -> None:
    harmony_tags = [
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|end|>",
        "<|constrain|>",
        "<|call|>",
    ]
    words = [
        "analysis",
        "Look",
        " up.",
        "assistant",
        "commentary to=functions.get",
        " json",
        '{"q":',
        ' "x"}',
        "<|other|>",
    ]
    vocab, ids = special_vocab([*harmony_tags, *words], [*harmony_tags, "<|other|>"])
    router = Router(vocab)
    spec = StreamSpec.anthropic(
        model="m",
        message_id="msg_1",
        reply=Reply(
            markup=Markup(tool_call="harmony"), eos_ids=[0, ids["<|call|>"]], tools=[("get", "{}")]
        ),
    )
    reader = router.open(1, spec, prompt_tokens=1, max_tokens=UNLIMITED)
    script = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "Look",
        "<|other|>",
        " up.",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|channel|>",
        "commentary to=functions.get",
        "<|constrain|>",
        " json",
        "<|message|>",
        '{"q":',
        ' "x"}',
    ]
    for token in script:
        assert router.step([1], [ids[token]]) == []
    assert router.step([1], [ids["<|call|>"]]) == [(1, TOOL_USE)]
    out = bytearray()
    while (chunk := reader.take()) is not None:
        out += chunk
    blocks, delta = anthropic_blocks(bytes(out))
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0]["thinking"] == "Look up."
    assert blocks[1]["name"] == "get" and json.loads(blocks[1]["json"]) == {"q": "x"}
    assert delta["stop_reason"] == "tool_use"
    assert b"<|" not in out


def test_kimi_special_tags_without_markup_render_nothing() -> None:
    tags = [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ]
    words = ["Sure.", "functions.ls:0", "{}"]
    vocab, ids = special_vocab([*tags, *words], tags)
    script = [
        ids[t]
        for t in ["Sure.", tags[0], tags[1], "functions.ls:0", tags[2], "{}", tags[3], tags[4]]
    ]
    for markup, want in [
        (Markup(tool_call="kimi_k2"), ["text", "tool_use"]),
        (None, ["text"]),
    ]:
        router = Router(vocab)
        spec = StreamSpec.anthropic(
            model="m", message_id="msg_1", reply=Reply(markup=markup, eos_ids=[0])
        )
        reader = router.open(1, spec, prompt_tokens=1, max_tokens=UNLIMITED)
        for token in script:
            router.step([1], [token])
        router.step([1], [0])
        out = bytearray()
        while (chunk := reader.take()) is not None:
            out += chunk
        blocks, _ = anthropic_blocks(bytes(out))
        assert [b["type"] for b in blocks] == want
        if markup is None:
            assert blocks[0]["text"] == "Sure.functions.ls:0{}"


def test_markup_accepts_every_format_name_and_each_has_its_prompt_side() -> None:
    from mlxgate import formats

    names = Markup.tool_formats()
    assert len(names) == 11 and names[-1] == "hermes"
    for name in names:
        assert Markup(tool_call=name).tool_call == name
        assert name == formats.TOOL_FORMATS[name].NAME
    assert list(formats.TOOL_FORMATS) == names
    with pytest.raises(NativeError, match='unknown tool call format "qwen"'):
        Markup(tool_call="qwen")


def test_one_reader_answers_every_choice_numbered_as_queued() -> None:
    """OpenAI's n: one response, its events numbered as they are queued (take_events says the
    last id taken), one usage chunk and one [DONE] after the last choice."""
    router = Router(text_vocab())
    spec = StreamSpec.openai(
        model="m", completion_id="c", created=1, include_usage=True, reply=Reply(eos_ids=[0])
    )
    reader = router.open([1, 2], spec, prompt_tokens=3, max_tokens=UNLIMITED)
    first, last_id = reader.take_events() or (b"", 0)
    assert last_id == 2 and first.startswith(b"id: 1\n") and b"\nid: 2\n" in first
    assert router.step([1, 2], [1, 2]) == []
    assert router.step([1], [0]) == [(1, FinishReason.END_TURN)]
    assert router.step([2], [0]) == [(2, FinishReason.END_TURN)]
    rest, last_id = reader.take_events() or (b"", 0)
    frames = sse_frames(rest.decode())
    assert rest.startswith(b"id: 3\n") and last_id == 2 + len(frames)
    assert frames[-1] == "data: [DONE]" and rest.count(b"[DONE]") == 1
    usage = [json.loads(f[6:]) for f in frames if '"choices":[]' in f]
    assert [u["usage"]["completion_tokens"] for u in usage] == [4]
    assert reader.take_events() is None
    with pytest.raises(NativeError, match="cannot have 2 choices"):
        router.open(
            [3, 4], StreamSpec.anthropic(model="m", message_id="x"), prompt_tokens=1, max_tokens=1
        )


def test_a_responses_reader_keeps_the_response_object() -> None:
    router = Router(text_vocab())
    for stream in (True, False):
        spec = StreamSpec.responses(
            model="m",
            response_id="resp_1",
            created_at=1,
            echo="{}",
            stream=stream,
            reply=Reply(eos_ids=[0]),
        )
        reader = router.open(1, spec, prompt_tokens=2, max_tokens=UNLIMITED)
        assert reader.result is None
        router.step([1, 1], [1, 0])
        body = b"".join(iter(reader.take, None))
        result = json.loads(reader.result or b"")
        assert result["status"] == "completed" and result["output"][0]["content"][0]["text"] == "Hi"
        if not stream:
            assert json.loads(body) == result
    assert Dialect.OPENAI.error_events(ErrorKind.INTERNAL, "x", 7)[1] == 8
