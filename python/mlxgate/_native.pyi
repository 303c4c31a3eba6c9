"""Rust stream core: token ids to text, markup and stop matching, Anthropic and OpenAI SSE events,
bounded channels."""

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar, final, type_check_only

from typing_extensions import Buffer

@type_check_only
class _IntArray(Protocol):
    """A 1-d integer array exposing the buffer protocol (numpy, mlx): numpy's stubs declare
    `__buffer__` only for Python >= 3.12, so match on `__array__` instead."""

    def __array__(self) -> Any: ...

_Ints = Sequence[int] | Buffer | _IntArray
_Waiter = TypeVar("_Waiter")

__all__ = ["Markup", "NativeError", "Reader", "Router", "Vocab"]

class NativeError(ValueError):
    """Invalid input to the stream core."""

@final
class Vocab:
    """Token id to bytes table, built once per model and shared by routers."""

    @staticmethod
    def from_token_strings(
        tokens: list[str],
        kind: Literal["byte_level", "sentencepiece"],
        special_ids: list[int],
        *,
        trim_leading_space: bool = False,
    ) -> Vocab:
        """Build from vocabulary strings: byte-level BPE (GPT-2 `Ġ`) or SentencePiece (`▁`,
        `<0xAB>` byte fallback). Special ids render to nothing. `trim_leading_space` drops one
        leading space from each stream's first text (SentencePiece tokenizers with a dummy
        prefix, e.g. Llama 2 and Mistral)."""

    @staticmethod
    def from_token_bytes(
        tokens: list[bytes], special_ids: list[int], *, trim_leading_space: bool = False
    ) -> Vocab:
        """Build from the raw bytes of every token."""

    def __len__(self) -> int: ...
    def decode(self, token_ids: list[int]) -> str:
        """Whole-sequence decode (special ids skipped, invalid UTF-8 as U+FFFD)."""

@final
class Markup:
    """A model's thinking and tool-call markup, built once per model and passed to every open.

    The router splits generated text into visible text, thinking and tool calls; raw tags never
    reach the client, and a tag split across tokens is held back until it is decided. Stop
    sequences are matched on visible text only (never inside thinking or tool-call JSON).
    Whitespace where markup meets text is trimmed (`text\n\n<tool_call>` gives the text `text`).

    think: open and close tags, e.g. ("<think>", "</think>"). Anthropic: a `thinking` block
    (`thinking_delta`s, then an empty `signature_delta`); OpenAI: `delta.reasoning_content`.

    tool_call: "hermes" (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`, Qwen/Hermes),
    "mistral" (`[TOOL_CALLS][{…}, …]`) or "llama3_json" (a reply that starts with
    `{"name": …, "parameters": {…}}`). `parameters` is accepted for `arguments` in every format,
    as is an arguments object encoded as a JSON string. A call starts (Anthropic `tool_use`
    block, OpenAI `delta.tool_calls` entry) once its name is known; its arguments stream as the
    model writes them (byte for byte, escapes kept), buffered only while the name is unknown.
    Tool ids are deterministic: `toolu_`/`call_` + 24 base62 chars hashed from the message or
    completion id and the call's position. A call that is malformed before its name is known is
    emitted as plain text; one that goes bad (or is cut off) later gets its arguments JSON closed
    validly. A generation that ends after a complete call finishes with `tool_use` /
    `tool_calls`; one cut off inside a call keeps its real reason (e.g. `max_tokens`).

    Tokens such as `<think>` or `<tool_call>` must not be in the vocab's special ids (those render
    to nothing)."""

    def __new__(
        cls,
        *,
        think: tuple[str, str] | None = None,
        tool_call: Literal["hermes", "mistral", "llama3_json"] | None = None,
    ) -> Markup:
        """Raises NativeError for an unknown tool_call format or an empty think tag."""

    @property
    def think(self) -> tuple[str, str] | None: ...
    @property
    def tool_call(self) -> Literal["hermes", "mistral", "llama3_json"] | None: ...

@final
class Reader:
    """Consumer side of one stream. Used from the asyncio thread. Dropping the last reference
    before the stream ends cancels it, like cancel()."""

    def take(self) -> bytes | None:
        """All pending bytes as one object; b"" if nothing is pending yet; None at end of stream."""

    def park(self, waiter: _Waiter, wake_all: Callable[[list[_Waiter]], object]) -> bool:
        """If data is pending or the stream is closed: return False and store nothing. Otherwise
        store `waiter` and `wake_all` (replacing an earlier pair) and return True. On the next
        append or close, from the engine thread, the router calls `wake_all` once with a list of
        the waiters of every reader it wakes at that moment (one step, or one fail, close, ping
        or cancel) that parked with this same `wake_all` object. So readers of one event loop
        should share one `wake_all` that hands the list to `loop.call_soon_threadsafe`
        (`mlxgate.streams.wake_all_for`): then one step wakes them all with one call. A
        `wake_all` that raises is reported as unraisable (sys.unraisablehook); the step goes
        on."""

    def cancel(self) -> None:
        """The client went away: drop pending bytes and end the stream (a parked waiter is woken).
        The router reports the id from its next step() or cancelled() call."""

    @property
    def unread_bytes(self) -> int: ...
    @property
    def stream_id(self) -> int: ...

@final
class Router:
    """Per-stream state for every open stream, fed once per engine step."""

    def __new__(cls, vocab: Vocab, *, max_unread_bytes: int = 1048576) -> Router: ...
    def open_anthropic(
        self,
        stream_id: int,
        *,
        model: str,
        message_id: str,
        input_tokens: int,
        cache_read_input_tokens: int = 0,
        stop_sequences: list[str] = ...,
        stream: bool = True,
        markup: Markup | None = None,
        prefill: str = "",
    ) -> Reader:
        """Open an Anthropic Messages stream. stream=True queues message_start and ping at once;
        stream=False makes the whole JSON Message body readable once the stream ends.
        `markup` parses thinking and tool calls (see Markup). `prefill` is markup the engine
        appended to the prompt (an opened `<think>`, or `<tool_call>\n{"name": "Bash",
        "arguments": ` to force a tool): the parser starts as if it had read it, the text itself
        is not emitted, and a tool call it names starts at once. Ignored without `markup`.
        Raises NativeError if `stream_id` is already open."""

    def open_openai(
        self,
        stream_id: int,
        *,
        model: str,
        completion_id: str,
        created: int,
        prompt_tokens: int,
        cached_tokens: int = 0,
        stop_sequences: list[str] = ...,
        stream: bool = True,
        include_usage: bool = False,
        kind: Literal["chat", "completion"] = "chat",
        markup: Markup | None = None,
        prefill: str = "",
    ) -> Reader:
        """Open an OpenAI stream. kind="chat" answers /v1/chat/completions
        (`chat.completion.chunk`s, the first with the assistant role, queued at once);
        "completion" answers /v1/completions (`text_completion`; plain text, markup ignored).
        Streaming: data-only SSE chunks ending in `data: [DONE]`; include_usage (stream_options)
        adds `"usage":null` to every chunk and a last chunk with empty choices and the usage.
        stream=False makes the JSON body readable once the stream ends. finish_reason: "stop"
        (EOS or stop sequence), "length" (max_tokens), "tool_calls". markup and prefill as in
        open_anthropic. Raises NativeError if `stream_id` is already open or `kind` is unknown."""

    def step(
        self,
        stream_ids: _Ints,
        token_ids: _Ints,
        finish_codes: _Ints,
    ) -> list[int]:
        """One engine step: stream_ids[i] produced token_ids[i]. finish_codes[i]: 0 running,
        1 end_turn (EOS, not rendered, counted), 2 max_tokens (rendered, then finish). Integer
        buffers (numpy arrays, array.array) are accepted too. Returns the stream ids the engine
        must drop now: stop sequence matched or reader cancelled. Unknown ids are ignored."""

    def cancelled(self) -> list[int]:
        """Ids of streams whose readers cancelled since the last report; they are removed."""

    def fail(self, stream_id: int, error_type: str, message: str) -> None:
        """End a stream with an error in its dialect and remove it. `error_type` is Anthropic's
        (`invalid_request_error`, `api_error`, `overloaded_error`, …). Anthropic: an SSE `error`
        event, or the error envelope as the body. OpenAI: `data: {"error": {message, type, param,
        code}}` then `data: [DONE]`, or `{"error": …}` as the body; the type maps to OpenAI's
        (invalid_request_error, not_found_error, request_too_large -> invalid_request_error;
        authentication_error, permission_error, rate_limit_error kept; api_error,
        overloaded_error and anything else -> server_error). Unknown ids are ignored."""

    def close(self, stream_id: int) -> None:
        """Remove a stream without emitting anything; its reader sees end of stream."""

    def ping(self, stream_id: int) -> None:
        """Queue a keep-alive (streaming only), e.g. during a long prefill: an Anthropic `ping`
        event, or an SSE comment `: keep-alive` on OpenAI streams."""

    def over_bound(self) -> list[int]:
        """Sorted ids of open streams whose readers hold more than `max_unread_bytes` unread."""

    def __len__(self) -> int: ...
