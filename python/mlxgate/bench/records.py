"""What a benchmark client saw of one request (`Record`), in any dialect, streamed or not, and
the record's JSONL form.

Reading a stream is per dialect (`Tally.frame`): Anthropic's typed events (pings ignored, an
`error` event a failure), OpenAI's chunks (a chunk with `error` a failure, `[DONE]` the end) and
Responses' typed events (`response.completed` / `.incomplete` the end, `response.failed` or
`error` a failure). A token's arrival is the arrival of a frame that carries generated text,
reasoning or tool-call arguments; its count is the server's usage."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DIALECTS = ("anthropic", "openai", "responses")
PATHS = {
    "anthropic": "/v1/messages",
    "openai": "/v1/chat/completions",
    "responses": "/v1/responses",
}

# Why a request failed, as the report counts failures.
ERROR_KINDS = (
    "http",  # an error status
    "error_event",  # the stream (or body) reported an error
    "truncated",  # the stream ended without its end event
    "bad_frame",  # a frame that is not the dialect's JSON
    "timeout",  # no whole answer in the time allowed
    "transport",  # the connection failed
)


@dataclass
class Record:
    """One request. Times are `time.monotonic()` seconds of the client's clock; the JSONL form
    counts them from the run's start (`sent_at`, `ended_at`) and from the send (`delta_times`)."""

    index: int
    dialect: str
    sent_at: float
    status: int | None = None
    headers_s: float | None = None  # from the send to the response's headers
    ttft_s: float | None = None  # from the send to the first generated token
    delta_times: list[float] = field(default_factory=list)  # each token frame's arrival
    output_tokens: int | None = None  # the server's usage
    input_tokens: int | None = None  # the whole prompt, its cached part included
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error_kind: str | None = None  # one of ERROR_KINDS
    error: str | None = None
    closed_early: bool = False  # the client closed the stream on purpose
    ended_at: float = 0.0
    target: str = ""
    scenario: str = ""
    concurrency: int = 0  # the clients of the run it was part of
    session: str = ""  # an agent replay's session (`index` is then its turn)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: the time between consecutive token frames."""
        return [b - a for a, b in itertools.pairwise(self.delta_times)]

    def fail(self, kind: str, message: str) -> None:
        assert kind in ERROR_KINDS, kind
        if self.error is None:
            self.error_kind, self.error = kind, message

    def to_json(self, run_started: float) -> dict[str, Any]:
        out = asdict(self)
        out["sent_at"] = round(self.sent_at - run_started, 6)
        out["ended_at"] = round(self.ended_at - run_started, 6)
        out["delta_times"] = [round(t - self.sent_at, 6) for t in self.delta_times]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], run_started: float = 0.0) -> Record:
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        record.sent_at += run_started
        record.ended_at += run_started
        record.delta_times = [record.sent_at + t for t in record.delta_times]
        return record


class Tally:
    """Applies a response's frames (or its whole body) to a `Record`, by dialect."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.ended = False
        self._event = {
            "anthropic": self._anthropic,
            "openai": self._openai,
            "responses": self._responses,
        }[record.dialect]

    def token(self, text: str, now: float) -> None:
        if text:
            record = self.record
            if not record.delta_times:
                record.ttft_s = now - record.sent_at
            record.delta_times.append(now)
            record.text += text

    def frame(self, event: str | None, data: Any, now: float) -> None:
        """One SSE frame: its `event:` (None without one) and its data, parsed (`[DONE]` as
        the string)."""
        if data == "[DONE]":
            self.ended = True
            return
        if not isinstance(data, dict):
            self.record.fail("bad_frame", f"a frame's data is not an object: {str(data)[:80]}")
            return
        self._event(data, now)

    def body(self, data: Any) -> None:
        """A whole (non-streamed) answer."""
        record = self.record
        if not isinstance(data, dict):
            record.fail("bad_frame", "the body is not a JSON object")
        elif data.get("error"):  # a Responses body has `"error": null`
            record.fail("error_event", _message(data["error"]))
        elif record.dialect == "anthropic":
            record.text = "".join(b.get("text", "") for b in data.get("content", []))
            record.finish_reason = data.get("stop_reason")
            self._anthropic_usage(data.get("usage") or {})
            record.output_tokens = (data.get("usage") or {}).get("output_tokens")
        elif record.dialect == "openai":
            choice = (data.get("choices") or [{}])[0]
            record.text = (choice.get("message") or {}).get("content") or ""
            record.finish_reason = choice.get("finish_reason")
            self._openai_usage(data.get("usage") or {})
        else:
            self._responses_end(data)
        self.ended = True

    def _anthropic(self, data: dict[str, Any], now: float) -> None:
        kind = data.get("type")
        if kind == "content_block_delta":
            delta = data.get("delta") or {}
            self.token(
                delta.get("text") or delta.get("thinking") or delta.get("partial_json") or "",
                now,
            )
        elif kind == "message_start":
            self._anthropic_usage((data.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            usage = data.get("usage") or {}
            self.record.output_tokens = usage.get("output_tokens")
            if "cache_read_input_tokens" in usage:  # more reused than message_start said
                self._anthropic_usage(usage)
            self.record.finish_reason = (data.get("delta") or {}).get("stop_reason")
        elif kind == "error":
            self.record.fail("error_event", _message(data.get("error")))
            self.ended = True
        elif kind == "message_stop":
            self.ended = True

    def _anthropic_usage(self, usage: dict[str, Any]) -> None:
        cached = usage.get("cache_read_input_tokens") or 0
        self.record.input_tokens = (usage.get("input_tokens") or 0) + cached
        self.record.cached_tokens = cached

    def _openai(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            self.record.fail("error_event", _message(data["error"]))
            return
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                text += (call.get("function") or {}).get("arguments") or ""
            self.token(text, now)
            if choice.get("finish_reason"):
                self.record.finish_reason = choice["finish_reason"]
        if usage := data.get("usage"):
            self._openai_usage(usage)

    def _openai_usage(self, usage: dict[str, Any]) -> None:
        record = self.record
        record.output_tokens = usage.get("completion_tokens")
        record.input_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    def _responses(self, data: dict[str, Any], now: float) -> None:
        kind = str(data.get("type"))
        if kind.endswith(".delta") and kind != "response.output_item.delta":
            delta = data.get("delta")
            self.token(delta if isinstance(delta, str) else "", now)
        elif kind in ("response.completed", "response.incomplete"):
            self._responses_end(data.get("response") or {})
            self.ended = True
        elif kind == "response.failed":
            error = (data.get("response") or {}).get("error")
            self.record.fail("error_event", _message(error))
            self.ended = True
        elif kind == "error":
            self.record.fail("error_event", _message(data))
            self.ended = True

    def _responses_end(self, response: dict[str, Any]) -> None:
        record = self.record
        usage = response.get("usage") or {}
        record.output_tokens = usage.get("output_tokens")
        record.input_tokens = usage.get("input_tokens")
        record.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        record.finish_reason = response.get("status")
        if not record.text:
            record.text = "".join(
                part.get("text", "")
                for item in response.get("output") or []
                for part in item.get("content") or []
            )


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:200]
    return str(error)[:200]
