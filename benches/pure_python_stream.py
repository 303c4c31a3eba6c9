"""The best pure-Python stream path, the baseline the Rust router is measured against.

Per stream: the end decided as the Rust router decides it (an end-of-turn token from the spec's
`eos_ids`, counted and not rendered; the `max_tokens` given to `open`), mlx-lm's streaming
detokenizer (the one mlx-lm picks for the tokenizer), stop sequences matched across token
boundaries with hold-back, Anthropic events encoded with orjson, SSE framing. Per step: one
`loop.call_soon_threadsafe` hands every stream's frames to the event loop, which appends them to
per-stream queues and wakes the readers waiting on them (one `wake_all` call per loop, as the
Rust router does).

`PyRouter` and `PyReader` have the interface of `mlxgate._native.Router` and `Reader` for
streamed Anthropic messages, so the same app and engine run on either. `open` reads the spec's
`model`, `stop_sequences` and `eos_ids`, and raises NotImplementedError for an OpenAI or a
non-streamed spec. A spec's markup and message id are not readable from Python: thinking and
tool-call markup streams as plain text, and each message gets an id of its own.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

from mlxgate._native import Dialect, ErrorKind, FinishReason, StreamSpec
from mlxgate.models.export import write_tokenizer
from mlxgate.models.tokenizer import ChatTokenizer

CONTEXT_LENGTH = 8192  # only written into tokenizer_config.json

WakeAll = Callable[[list[Any]], object]  # see Reader.park


def mlx_lm_tokenizer(tokenizer: ChatTokenizer) -> TokenizerWrapper:
    """mlx-lm's wrapper for this tokenizer, with the streaming detokenizer mlx-lm picks for it."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(tokenizer, Path(tmp), CONTEXT_LENGTH)
        return load_mlx_lm_tokenizer(Path(tmp))


def sse(event: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


TEXT_DELTA = b"event: content_block_delta\ndata: "
PING = sse("ping", {"type": "ping"})
BLOCK_START = sse(
    "content_block_start",
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
)
STOP_REASONS = {
    FinishReason.END_TURN: "end_turn",
    FinishReason.MAX_TOKENS: "max_tokens",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
}
# Anthropic's error type and HTTP status for each kind (as Dialect.ANTHROPIC words them).
ERRORS = {
    ErrorKind.INVALID_REQUEST: ("invalid_request_error", 400),
    ErrorKind.AUTHENTICATION: ("authentication_error", 401),
    ErrorKind.PERMISSION: ("permission_error", 403),
    ErrorKind.NOT_FOUND: ("not_found_error", 404),
    ErrorKind.REQUEST_TOO_LARGE: ("request_too_large", 413),
    ErrorKind.RATE_LIMITED: ("rate_limit_error", 429),
    ErrorKind.OVERLOADED: ("overloaded_error", 529),
    ErrorKind.UNAVAILABLE: ("overloaded_error", 503),
    ErrorKind.INTERNAL: ("api_error", 500),
}


class StopMatcher:
    """Finds stop sequences across token boundaries, holding back text that may begin one."""

    def __init__(self, stop_sequences: Sequence[str]) -> None:
        self.stops = [s for s in stop_sequences if s]
        self.prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self.longest_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text safe to emit, and the stop sequence that ended the stream, if one did."""
        if self.held:
            text = self.held + text
            self.held = ""
        if not text or not self.stops:
            return text, None
        end, matched = len(text), None
        for stop in self.stops:
            at = text.find(stop)
            if 0 <= at < end:
                end, matched = at, stop
        if matched is not None:
            return text[:end], matched
        for k in range(min(self.longest_prefix, len(text)), 0, -1):
            if text[-k:] in self.prefixes:
                self.held = text[-k:]
                return text[:-k], None
        return text, None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class PyReader:
    """Consumer side of one stream; all of its state is touched on the event loop thread only."""

    def __init__(self, stream_id: int, on_cancel: Callable[[PyReader], None]) -> None:
        self.stream_id = stream_id
        self.status = 200  # or the error's (PyRouter.fail)
        self._on_cancel = on_cancel
        self._queue: list[bytes] = []
        self._unread = 0
        self._closed = False
        self._parked: tuple[object, WakeAll] | None = None

    def take(self) -> bytes | None:
        if self._queue:
            data = b"".join(self._queue) if len(self._queue) > 1 else self._queue[0]
            self._queue = []
            self._unread = 0
            return data
        return None if self._closed else b""

    def park(self, waiter: object, wake_all: WakeAll) -> bool:
        if self._queue or self._closed:
            return False
        self._parked = (waiter, wake_all)
        return True

    def cancel(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue = []
        self._unread = 0
        self._on_cancel(self)
        if parked := self._unpark():
            waiter, wake_all = parked
            wake_all([waiter])

    @property
    def unread_bytes(self) -> int:
        return self._unread

    def put(self, data: bytes, closed: bool) -> tuple[object, WakeAll] | None:
        """Queue `data`; returns what the reader parked, for the caller to wake."""
        if self._closed:
            return None
        if data:
            self._queue.append(data)
            self._unread += len(data)
        self._closed = closed
        return self._unpark()

    def _unpark(self) -> tuple[object, WakeAll] | None:
        parked, self._parked = self._parked, None
        return parked


def _deliver(deliveries: Iterable[tuple[PyReader, bytes, bool]]) -> None:
    """On the event loop: one step's frames into each stream's queue, then one call per wake_all
    with the waiters of every reader parked with it."""
    woken: dict[WakeAll, list[object]] = {}
    for reader, data, closed in deliveries:
        parked = reader.put(data, closed)
        if parked is not None:
            waiter, wake_all = parked
            woken.setdefault(wake_all, []).append(waiter)
    for wake_all, waiters in woken.items():
        wake_all(waiters)


class _AnthropicStream:
    """One streamed Anthropic message: tokens in, SSE frames out, and when it ends."""

    def __init__(
        self,
        reader: PyReader,
        detokenizer: StreamingDetokenizer,
        stop: StopMatcher,
        eos_ids: frozenset[int],
        max_tokens: int,
    ) -> None:
        self.reader = reader
        self.detokenizer = detokenizer
        self.stop = stop
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.output_tokens = 0
        self.block_open = False
        self.finish: FinishReason | None = None
        self.stop_sequence: str | None = None

    def step(self, token_id: int) -> bytes:
        """The frames `token_id` adds; sets `finish` if it ends the stream."""
        self.output_tokens += 1
        detokenizer = self.detokenizer
        end = None
        if token_id in self.eos_ids:  # counted, not rendered
            end = FinishReason.END_TURN
            detokenizer.finalize()
        else:
            detokenizer.add_token(token_id)
            if self.output_tokens >= self.max_tokens:
                end = FinishReason.MAX_TOKENS
                detokenizer.finalize()
        text, self.stop_sequence = self.stop.feed(detokenizer.last_segment)
        frames = self._text_delta(text) if text else b""
        if self.stop_sequence is not None:
            end = FinishReason.STOP_SEQUENCE
        elif end is None:
            return frames
        elif held := self.stop.flush():
            frames += self._text_delta(held)
        self.finish = end
        return frames + self._finish(STOP_REASONS[end])

    def _text_delta(self, text: str) -> bytes:
        frame = (
            TEXT_DELTA
            + orjson.dumps(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": text},
                }
            )
            + b"\n\n"
        )
        if self.block_open:
            return frame
        self.block_open = True
        return BLOCK_START + frame

    def _finish(self, stop_reason: str) -> bytes:
        frames = b"" if self.block_open else BLOCK_START
        return (
            frames
            + sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": {"output_tokens": self.output_tokens},
                },
            )
            + sse("message_stop", {"type": "message_stop"})
        )


def _ints(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


class PyRouter:
    """Per-stream state for every open stream, fed once per engine step (see Router)."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        max_unread_bytes: int = 1 << 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_unread_bytes = max_unread_bytes
        self._loop = loop
        self._streams: dict[int, _AnthropicStream] = {}
        # Appended to on the event loop thread, drained on the engine thread.
        self._cancel_inbox: deque[PyReader] = deque()

    def open(
        self,
        stream_id: int,
        spec: StreamSpec,
        *,
        prompt_tokens: int,
        cached_tokens: int = 0,
        max_tokens: int,
    ) -> PyReader:
        """Called on the event loop thread (where the engine's `admit` runs)."""
        if spec.dialect != Dialect.ANTHROPIC or not spec.stream:
            raise NotImplementedError("the pure-Python path streams Anthropic messages only")
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id} is already open")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        reader = PyReader(stream_id, self._cancel_inbox.append)
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": spec.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens - cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached_tokens,
                "output_tokens": 0,
            },
        }
        start = sse("message_start", {"type": "message_start", "message": message})
        reader.put(start + PING, False)
        self._streams[stream_id] = _AnthropicStream(
            reader,
            self.tokenizer.detokenizer,
            StopMatcher(spec.stop_sequences),
            frozenset(spec.eos_ids),
            max(max_tokens, 1),
        )
        return reader

    def step(self, stream_ids: Any, token_ids: Any) -> list[tuple[int, FinishReason]]:
        """Called on the engine thread. Returns every stream that ended, and why (those are
        removed): cancelled since the last report, an end-of-turn token, max_tokens, a stop
        sequence. Unknown ids are ignored."""
        ended = [(stream_id, FinishReason.CANCELLED) for stream_id in self._drain_cancelled()]
        streams = self._streams
        deliveries: list[tuple[PyReader, bytes, bool]] = []
        for stream_id, token_id in zip(_ints(stream_ids), _ints(token_ids), strict=True):
            stream = streams.get(stream_id)
            if stream is None:
                continue
            data = stream.step(token_id)
            finish = stream.finish
            if finish is not None:
                del streams[stream_id]
                ended.append((stream_id, finish))
            if data:
                deliveries.append((stream.reader, data, finish is not None))
        if deliveries:
            self._send(deliveries)
        return ended

    def cancelled(self) -> list[int]:
        return self._drain_cancelled()

    def fail(self, stream_id: int, kind: ErrorKind, message: str) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            error_type, stream.reader.status = ERRORS[kind]
            error = {"type": "error", "error": {"type": error_type, "message": message}}
            self._send([(stream.reader, sse("error", error), True)])

    def close(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._send([(stream.reader, b"", True)])

    def ping(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._send([(stream.reader, PING, False)])

    def over_bound(self) -> list[int]:
        streams = list(self._streams.items())
        return sorted(i for i, s in streams if s.reader.unread_bytes > self.max_unread_bytes)

    def __len__(self) -> int:
        return len(self._streams)

    def _drain_cancelled(self) -> list[int]:
        """Remove the streams whose readers cancelled (not a later stream reusing the id)."""
        gone = []
        while self._cancel_inbox:
            reader = self._cancel_inbox.popleft()
            stream = self._streams.get(reader.stream_id)
            if stream is not None and stream.reader is reader:
                del self._streams[reader.stream_id]
                gone.append(reader.stream_id)
        return gone

    def _send(self, deliveries: list[tuple[PyReader, bytes, bool]]) -> None:
        assert self._loop is not None, "no stream was opened"
        self._loop.call_soon_threadsafe(_deliver, deliveries)
