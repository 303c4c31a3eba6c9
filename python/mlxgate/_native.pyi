"""Rust stream core: token ids to text, stop matching, Anthropic SSE events, bounded channels."""

from collections.abc import Callable, Sequence
from typing import Literal, final

__all__ = ["NativeError", "Reader", "Router", "Vocab"]

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
class Reader:
    """Consumer side of one stream. Used from the asyncio thread. Dropping the last reference
    before the stream ends cancels it, like cancel()."""

    def take(self) -> bytes | None:
        """All pending bytes as one object; b"" if nothing is pending yet; None at end of stream."""

    def park(self, wake: Callable[[], object]) -> bool:
        """If data is pending or the stream is closed: return False and do not store `wake`.
        Otherwise store it (replacing an earlier one) and return True; the producer calls it once,
        from the engine thread, on the next append or close."""

    def cancel(self) -> None:
        """The client went away: drop pending bytes and end the stream (a parked `wake` is called).
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
    ) -> Reader:
        """Open an Anthropic Messages stream. stream=True queues message_start and ping at once;
        stream=False makes the whole JSON Message body readable once the stream ends.
        Raises NativeError if `stream_id` is already open."""

    def step(
        self,
        stream_ids: Sequence[int],
        token_ids: Sequence[int],
        finish_codes: Sequence[int],
    ) -> list[int]:
        """One engine step: stream_ids[i] produced token_ids[i]. finish_codes[i]: 0 running,
        1 end_turn (EOS, not rendered, counted), 2 max_tokens (rendered, then finish). Integer
        buffers (numpy arrays, array.array) are accepted too. Returns the stream ids the engine
        must drop now: stop sequence matched or reader cancelled. Unknown ids are ignored."""

    def cancelled(self) -> list[int]:
        """Ids of streams whose readers cancelled since the last report; they are removed."""

    def fail(self, stream_id: int, error_type: str, message: str) -> None:
        """End a stream with an Anthropic error (SSE `error` event, or the error body when not
        streaming) and remove it. Unknown ids are ignored."""

    def close(self, stream_id: int) -> None:
        """Remove a stream without emitting anything; its reader sees end of stream."""

    def ping(self, stream_id: int) -> None:
        """Queue a keep-alive `ping` event (streaming only), e.g. during a long prefill."""

    def over_bound(self) -> list[int]:
        """Sorted ids of open streams whose readers hold more than `max_unread_bytes` unread."""

    def __len__(self) -> int: ...
