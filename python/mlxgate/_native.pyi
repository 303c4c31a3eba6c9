"""Rust stream core: token ids to text, markup and stop matching, Anthropic and OpenAI SSE events,
bounded channels."""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol, TypeVar, final, type_check_only

from typing_extensions import Buffer

@type_check_only
class _IntArray(Protocol):
    """A 1-d integer array exposing the buffer protocol (numpy, mlx): numpy's stubs declare
    `__buffer__` only for Python >= 3.12, so match on `__array__` instead."""

    def __array__(self) -> Any: ...

_Ints = Sequence[int] | Buffer | _IntArray
_Waiter = TypeVar("_Waiter")

__all__ = [
    "Dialect",
    "ErrorKind",
    "FinishReason",
    "Markup",
    "NativeError",
    "Reader",
    "Reply",
    "Router",
    "StreamSpec",
    "Vocab",
    "compaction_from_encrypted",
    "event_data",
    "events_after",
    "reasoning_from_encrypted",
    "websocket_error",
]

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

    think: open and close tags, e.g. ("<think>", "</think>"), ("[THINK]", "[/THINK]") or
    ("<seed:think>", "</seed:think>"). Anthropic: a `thinking` block (`thinking_delta`s, then an
    empty `signature_delta`); OpenAI: `delta.reasoning_content`.

    tool_call: the format's name. JSON formats: "hermes" (`<tool_call>{"name": …, "arguments":
    {…}}</tool_call>`, Qwen/Hermes), "mistral" (`[TOOL_CALLS][{…}, …]`), "llama3_json" (a reply
    that starts with `{"name": …, "parameters": {…}}`), "mistral_v11" (`[TOOL_CALLS]NAME[ARGS]{…}`
    per call), "kimi_k2" (`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{…}<|tool_call_end|>…`), "deepseek_v3" (V3.1:
    `tool▁calls▁begin`, then per call `tool▁call▁begin` NAME `tool▁sep` {…} `tool▁call▁end`,
    each tag between DeepSeek's fullwidth bars; also V3's fenced `function tool▁sep NAME` form).
    XML formats, whose parameters are raw
    text typed by the tool's input schema (see Reply's `tools`): "qwen3_coder"
    (`<tool_call><function=NAME><parameter=K>\nV\n</parameter></function></tool_call>`; a Hermes
    JSON object after `<tool_call>` is read too), "seed_oss" (the same inside `<seed:tool_call>`),
    "minimax_m2" (`<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>
    </invoke>…`), "glm" (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…`).
    "harmony" (gpt-oss) reads the whole reply as channel messages: `analysis` is thinking, `final`
    and commentary without a recipient are text, `to=functions.NAME` is a call whose arguments
    stream as written; `think` is not needed.

    In the JSON formats `parameters` is accepted for `arguments`, as is an arguments object
    encoded as a JSON string. A call starts (Anthropic `tool_use` block, OpenAI
    `delta.tool_calls` entry) once its name is known; its arguments stream as the model writes
    them (JSON formats: byte for byte, escapes kept; XML formats: converted to compact JSON as
    each parameter is written, string values streaming as they arrive). Tool ids are
    deterministic: `toolu_`/`call_` + 24 base62 chars hashed from the message or completion id and
    the call's position. A call that is malformed before its name is known is emitted as plain
    text; one that goes bad (or is cut off) later gets its arguments JSON closed validly. A
    generation that ends after a complete call finishes with `tool_use` / `tool_calls`; one cut
    off inside a call keeps its real reason (e.g. `max_tokens`).

    Special tokens render to nothing (see Vocab), except in a stream with markup a special token
    whose text is one of the markup's tags (the think pair, or any tag the tool format writes,
    e.g. harmony's `<|channel|>`, Kimi's `<|tool_call_begin|>`, `[TOOL_CALLS]`): that one reaches
    the parser. An EOS id (the spec's `eos_ids`, e.g. harmony's `<|call|>` and `<|return|>`)
    still only ends the stream."""

    def __new__(
        cls,
        *,
        think: tuple[str, str] | None = None,
        tool_call: str | None = None,
    ) -> Markup:
        """Raises NativeError for an unknown tool_call format or an empty think tag."""

    @property
    def think(self) -> tuple[str, str] | None: ...
    @property
    def tool_call(self) -> str | None: ...
    @staticmethod
    def tool_formats() -> list[str]:
        """Every tool-call format's name, in the order chat templates are matched against them
        (Hermes, the fallback, last)."""

@final
class FinishReason:
    """Why a stream ended: what `Router.step` reports for every row that ended."""

    END_TURN: ClassVar[FinishReason]
    """An end-of-turn token (one of the spec's `eos_ids`): counted, not rendered."""
    MAX_TOKENS: ClassVar[FinishReason]
    STOP_SEQUENCE: ClassVar[FinishReason]
    TOOL_USE: ClassVar[FinishReason]
    """The generation ended after at least one complete tool call."""
    CANCELLED: ClassVar[FinishReason]
    """The reader went away."""
    REPETITION: ClassVar[FinishReason]
    """The loop guard ended a reply that repeats itself."""
    def __int__(self) -> int: ...

@final
class ErrorKind:
    """What went wrong, in no dialect's words; a `Dialect` words it and picks the status."""

    INVALID_REQUEST: ClassVar[ErrorKind]
    AUTHENTICATION: ClassVar[ErrorKind]
    PERMISSION: ClassVar[ErrorKind]
    NOT_FOUND: ClassVar[ErrorKind]
    REQUEST_TOO_LARGE: ClassVar[ErrorKind]
    RATE_LIMITED: ClassVar[ErrorKind]
    OVERLOADED: ClassVar[ErrorKind]
    UNAVAILABLE: ClassVar[ErrorKind]
    INTERNAL: ClassVar[ErrorKind]
    def __int__(self) -> int: ...

@final
class Dialect:
    """An API dialect: its error envelope and the status codes its clients act on.

    Anthropic: `{"type":"error","error":{"type","message"}}`; 400 invalid_request_error, 401
    authentication_error, 403 permission_error, 404 not_found_error, 413 request_too_large, 429
    rate_limit_error, 529 (overloaded) and 503 (unavailable) overloaded_error, 500 api_error.
    OpenAI: `{"error":{"message","type","param","code"}}`; client errors (400, 401, 403, 404,
    413) invalid_request_error, 429 rate_limit_error, 503 (overloaded, unavailable) and 500
    server_error. Responses: OpenAI's envelope and statuses; a stream's last frame is an `error`
    event."""

    ANTHROPIC: ClassVar[Dialect]
    OPENAI: ClassVar[Dialect]
    RESPONSES: ClassVar[Dialect]
    def __int__(self) -> int: ...
    def error_status(self, kind: ErrorKind) -> int: ...
    def error_reply(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        stream: bool = False,
    ) -> bytes:
        """The envelope as a whole body, or (`stream`) as a stream's last frames: Anthropic's
        `event: error`, OpenAI's `data: {"error": …}` then `data: [DONE]`."""
    def error_events(self, kind: ErrorKind, message: str, first_id: int) -> tuple[bytes, int]:
        """A stream's last frames for an error, numbered from `first_id` as the stream's other
        events are, and the id of the last one (a stream that failed outside the engine)."""

@final
class Reply:
    """What a stream needs from the model's side, built once per rendered prompt.

    `markup` parses thinking and tool calls (see Markup). `prefill` is markup the prompt already
    ends with (an opened `<think>`, or `<tool_call>\n{"name": "Bash", "arguments": ` to force a
    tool): the parser starts as if it had read it, the text itself is not emitted, and a tool
    call it names starts at once. Ignored without `markup`. `eos_ids` end the turn. `tools` are
    the rendered tools' (name, input schema as JSON text): the XML formats type the parameters
    they parse by them."""

    def __new__(
        cls,
        *,
        markup: Markup | None = None,
        prefill: str = "",
        eos_ids: list[int] = ...,
        tools: Sequence[tuple[str, str]] = ...,
    ) -> Reply: ...
    @property
    def markup(self) -> Markup | None: ...
    @property
    def prefill(self) -> str: ...
    @property
    def eos_ids(self) -> list[int]: ...
    @property
    def tools(self) -> list[tuple[str, str]]: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class StreamSpec:
    """How one request's stream reads and when it ends, all but the engine's numbers: built by
    the API (its dialect's parameters, stop sequences and the prompt's `Reply`: plain text
    without one), handed to `Router.open` by the engine."""

    @staticmethod
    def anthropic(
        *,
        model: str,
        message_id: str,
        stream: bool = True,
        compaction: bool = False,
        compacted: str | None = None,
        applied_edits: str | None = None,
        stop_sequences: list[str] = ...,
        reply: Reply | None = None,
        tool_search: tuple[str, str, list[tuple[str, str]]] | None = None,
    ) -> StreamSpec:
        """An Anthropic Messages stream. stream=True queues message_start and ping at once;
        stream=False makes the whole JSON Message body readable once the stream ends. With
        `compaction`, the reply's text is a summary of the conversation: the content is one
        `compaction` block (streamed as one `compaction_delta`) and the stop reason
        `compaction`. `compacted` is a summary made before this generation, the message's first
        block. `applied_edits` (a JSON array) is reported as the message's
        `context_management.applied_edits`.
        `tool_search` (the search tool's name, "regex" or "bm25", each deferred tool's name
        and the text it is found by): the stream answers the model's calls of that tool itself,
        with a `server_tool_use` and a `tool_search_tool_result` block, and a reply that
        called only it ends with `pause_turn`."""

    @staticmethod
    def openai(
        *,
        model: str,
        completion_id: str,
        created: int,
        stream: bool = True,
        include_usage: bool = False,
        kind: Literal["chat", "completion"] = "chat",
        custom_tools: list[str] = ...,
        stop_sequences: list[str] = ...,
        reply: Reply | None = None,
    ) -> StreamSpec:
        """An OpenAI stream. kind="chat" answers /v1/chat/completions (`chat.completion.chunk`s,
        the first with the assistant role, queued at once); "completion" answers /v1/completions
        (`text_completion`; plain text, markup ignored). Streaming: data-only SSE chunks ending in
        `data: [DONE]`; include_usage (stream_options) adds `"usage":null` to every chunk and a
        last chunk with empty choices and the usage. stream=False makes the JSON body readable
        once the stream ends. finish_reason: "stop" (EOS or stop sequence), "length"
        (max_tokens), "tool_calls". A response opened with several stream ids (OpenAI's `n`)
        writes every choice, each with its index, then one usage chunk and one `[DONE]` (or one
        body with every choice, the prompt counted once in its usage). A call of one of
        `custom_tools` is a `custom` tool call whose `input` is the text of the call's `input`
        argument, streamed decoded. Raises NativeError if `kind` is unknown."""

    @staticmethod
    def responses(
        *,
        model: str,
        response_id: str,
        created_at: int,
        echo: str,
        stream: bool = True,
        reasoning_summary: bool = False,
        encrypted_reasoning: bool = False,
        namespaced: Sequence[tuple[str, str, str]] = ...,
        custom_tools: list[str] = ...,
        compaction: Literal["item", "endpoint"] | None = None,
        kept_items: str | None = None,
        stop_sequences: list[str] = ...,
        reply: Reply | None = None,
    ) -> StreamSpec:
        """An OpenAI Responses stream. Streaming: typed SSE events (`event:` + `data:` with `type`
        and `sequence_number`): `response.created`, `response.in_progress`, per output item
        `response.output_item.added`, its parts and deltas (output text, reasoning text or, with
        reasoning_summary, a reasoning summary; function call arguments) and `.done` events, then
        `response.completed` (`response.incomplete` at max_output_tokens; `response.failed` on an
        error), each carrying the Response object; a keep-alive is `response.in_progress` again.
        stream=False makes the Response object readable once the stream ends. `echo` is a JSON
        object of the request's settings every Response object repeats after its own members.
        encrypted_reasoning adds `encrypted_content` to reasoning items (see
        `reasoning_from_encrypted`). `namespaced` lists (flat name, namespace, name): a call of
        the flat name goes out as `name` with `namespace`. A call of one of `custom_tools` is a
        `custom_tool_call` item whose `input` is the text of the call's `input` argument
        (`response.custom_tool_call_input.delta` / `.done`). With `compaction`, the reply's text
        is a summary of the conversation and the output is one `compaction` item whose
        `encrypted_content` carries it (see `compaction_from_encrypted`): in a Response ("item"),
        or ("endpoint", not streamed) in `/v1/responses/compact`'s `response.compaction` object,
        after `kept_items` (a JSON array). Raises NativeError for another `compaction`."""

    def empty_response(self) -> tuple[bytes, bytes | None]:
        """A response that generates nothing (the Responses API's `generate: false`): its frames
        from opening to end (Responses: `response.created`, `.in_progress`, `.completed` with no
        output and zero usage), and the response object it ends with (None where the dialect
        keeps none)."""
    @property
    def dialect(self) -> Dialect: ...
    @property
    def stream(self) -> bool: ...
    @property
    def model(self) -> str: ...
    @property
    def stop_sequences(self) -> list[str]: ...
    @property
    def eos_ids(self) -> list[int]: ...

@final
class Reader:
    """Consumer side of one response (all its choices). Used from the asyncio thread. Dropping
    the last reference before the response ends cancels it, like cancel(). A streamed response's
    events come numbered: each starts with an `id: N` line, N counting from 1."""

    def take(self) -> bytes | None:
        """All pending bytes as one object; b"" if nothing is pending yet; None at end of stream."""

    def take_events(self) -> tuple[bytes, int] | None:
        """As take(), with the id of the last event taken so far (0 before any, and for a
        response that is not streamed)."""

    def park(self, waiter: _Waiter, wake_all: Callable[[list[_Waiter]], object]) -> bool:
        """If data is pending or the stream is closed: return False and store nothing. Otherwise
        store `waiter` and `wake_all` (replacing an earlier pair) and return True. On the next
        append or close, from the engine thread, the router calls `wake_all` once with a list of
        the waiters of every reader it wakes at that moment (one step, or one fail, close, ping
        or cancel) that parked with this same `wake_all` object. So readers of one event loop
        should share one `wake_all` that hands the list to `loop.call_soon_threadsafe`
        (`mlxgate.api.reader.wake_all_for`): then one step wakes them all with one call. A
        `wake_all` that raises is reported as unraisable (sys.unraisablehook); the step goes
        on."""

    def cancel(self) -> None:
        """The client went away: drop pending bytes and end the response (a parked waiter is
        woken). The router reports its stream ids from its next step() or cancelled() call."""

    @property
    def unread_bytes(self) -> int: ...
    @property
    def stream_id(self) -> int:
        """The id of the response's first (usually only) stream."""
    @property
    def prompt_tokens(self) -> tuple[int, int]:
        """(prompt tokens, of them from the prefix cache), as opened."""
    @property
    def cached_from(self) -> str:
        """Where its cached prompt tokens came from: "memory", "disk", "in-flight", or ""."""
    @property
    def guesses(self) -> tuple[str, int, int]:
        """(what guessed for it: "prompt-lookup", "draft-model" or "", tokens guessed, of them
        kept), over its verify passes."""
    @property
    def output_tokens(self) -> int:
        """Tokens generated so far (all of them once the stream ended)."""
    @property
    def ttft_s(self) -> float | None:
        """Seconds from the stream's opening to its first token; None before it."""
    @property
    def end(self) -> str:
        """`running`, `finished`, `cancelled`, or the error kind that ended the stream
        (`overloaded`, `unavailable`, `internal`, ...)."""
    @property
    def status(self) -> int:
        """200, or the HTTP status of the error the stream ended with (`Router.fail`)."""
    @property
    def result(self) -> bytes | None:
        """What a finished generation is kept for, where the dialect keeps something (Responses:
        the Response object, completed, incomplete or failed; an Anthropic compaction: its
        summary's UTF-8 text); None otherwise."""

@final
class Router:
    """Per-stream state for every open stream, fed once per engine step."""

    def __new__(cls, vocab: Vocab, *, max_unread_bytes: int = 1048576) -> Router: ...
    def open(
        self,
        stream_ids: int | _Ints,
        spec: StreamSpec,
        *,
        prompt_tokens: int,
        cached_tokens: int = 0,
        cached_from: str = "",
        max_tokens: int,
        loop_span: int = 0,
    ) -> Reader:
        """Open a response as `spec` says for an admitted prompt of `prompt_tokens` (of which
        `cached_tokens` came from the prefix cache's tier `cached_from`: "memory", "disk" or
        "in-flight") that may add `max_tokens` tokens per stream: one stream, or one per id for
        the choices of OpenAI's `n`, all read by the one reader. Frames due at once are queued.
        With `loop_span` (tokens), each stream's loop guard ends a reply whose last `loop_span`
        tokens or more repeat one cycle (of at most 256 tokens, at least 4 times), reported as
        FinishReason.REPETITION.
        Raises NativeError if an id is already open, for several ids in a dialect without
        choices, or for another tier."""

    def step(self, stream_ids: _Ints, token_ids: _Ints) -> list[tuple[int, FinishReason]]:
        """One engine step: stream_ids[i] produced token_ids[i]. Returns every stream that ended,
        and why: an end-of-turn token, max_tokens, a stop sequence, a finished tool call, or a
        reader that cancelled since the last report (those are removed). The engine drops
        exactly these. Integer buffers (numpy arrays, array.array) are accepted too. Unknown ids
        are ignored."""

    def logprobs(self, sampled: list[tuple[int, int, float, list[tuple[int, float]]]]) -> None:
        """The log-probabilities of tokens the next `step` brings, for the streams whose requests
        asked for them: `(stream id, token id, logprob, [(alternative id, logprob), ...])`. An
        OpenAI stream writes them with the text those tokens release (`logprobs` of its chunk or
        body); other dialects drop them; an end-of-turn token has none. Unknown ids are
        ignored."""

    def cancelled(self) -> list[int]:
        """Ids of streams whose readers cancelled since the last report; they are removed."""

    def fail(self, stream_id: int, kind: ErrorKind, message: str) -> None:
        """End a stream's response with an error in its dialect (see Dialect) and remove the
        stream: the error's last frames when streaming, else the envelope as the body, and the
        reader's `status` becomes the dialect's status for `kind`. The response's other choices
        are reported cancelled by the next step() or cancelled(). Unknown ids are ignored."""

    def close(self, stream_id: int) -> None:
        """Remove a stream, and its response's other choices, without emitting anything; its
        reader sees end of stream."""

    def ping(self, stream_id: int) -> None:
        """Queue a keep-alive (streaming only), e.g. during a long prefill: Anthropic's `ping`
        event, an empty OpenAI chunk, Responses' `response.in_progress`. Only a response's
        first choice pings."""

    def guessed(
        self, stream_ids: list[int], guessed: list[int], kept: list[int], drafter: str
    ) -> None:
        """Verify passes checked `guessed[i]` tokens `drafter` ("prompt-lookup" or
        "draft-model") guessed for stream `stream_ids[i]`, which kept `kept[i]` of them; the
        request log says so. Raises NativeError for another drafter or lengths that differ;
        unknown ids are ignored."""

    def cached(self, stream_id: int, cached_tokens: int, cached_from: str) -> None:
        """The stream's prompt reused `cached_tokens` from the prefix cache's tier `cached_from`
        ("memory", "disk", or "in-flight": another prompt's prefill it waited for); the usage
        reported at its end (a body, OpenAI's usage chunk, Responses' completed response,
        Anthropic's message_delta where it differs from message_start) says so, and the request
        log names the tier. Raises NativeError for another tier; unknown ids are ignored."""

    def fail_stalled(self, timeout_s: float) -> list[int]:
        """End with an `overloaded` error every response whose reader has held more than
        `max_unread_bytes` unread for longer than `timeout_s` (the router keeps the clock), and
        return the ids of its streams, sorted: the engine drops them."""

    def over_bound(self) -> list[int]:
        """Sorted ids of open streams whose readers hold more than `max_unread_bytes` unread."""

    def __len__(self) -> int: ...

def reasoning_from_encrypted(encrypted: str) -> str | None:
    """The reasoning text inside an `encrypted_content` this server handed out (None for any other
    string), so a replayed reasoning item renders exactly as the model wrote it."""

def events_after(frames: bytes, last_id: int) -> bytes:
    """The frames of numbered `frames` (what `Reader.take` returned) after the event with id
    `last_id`: all of them if they start later, none if they end sooner."""

def compaction_from_encrypted(encrypted: str) -> str | None:
    """The summary inside a compaction item's `encrypted_content` this server handed out (None for
    any other string), so a replayed compaction renders the summary the model wrote."""

def event_data(frames: bytes) -> list[str]:
    """The data of each event in `frames` (what `Reader.take` returned; comments have none), in
    order: the JSON a WebSocket sends as one text message per event."""

def websocket_error(
    kind: ErrorKind, message: str, *, param: str | None = None, code: str | None = None
) -> str:
    """An error answering a Responses `response.create` sent over a WebSocket, as its one text
    message: `{"type":"error","status":…,"error":{"message","type","param","code"}}`, the status
    and error object the HTTP request would have had."""
