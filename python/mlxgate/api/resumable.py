"""Resumable streams (`--resume-window S`): a stream's events go into its `EventLog`, which the
connection follows; when the client drops, the generation goes on into the log for S seconds, and
`GET /v1/streams/{request-id}` with `Last-Event-ID` replays the events after that id and follows
the rest live. Nothing is lost or sent twice across a reconnect: a reconnect starts at the event
after the one the client names."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from mlxgate._native import Dialect, ErrorKind, Reader, events_after
from mlxgate.api.errors import ApiError, invalid
from mlxgate.api.http import (
    END,
    REQUEST_ID,
    Receive,
    Scope,
    Send,
    header,
    start_event_stream,
    wait_disconnect,
)
from mlxgate.api.reader import frames
from mlxgate.api.routing import Route, path_tail

log = logging.getLogger("mlxgate")

# A log holds at most this much not yet handed to a connection (beyond it the generation waits,
# and the engine ends it as stalled if nobody reads), and as much again already handed out, for
# replay (the bytes a dropped connection may have lost in flight).
BUFFER_BYTES = 4 << 20


def request_id(scope: Scope) -> str:
    """The id the app gave the request (its `request-id` header); a stream's id too."""
    return str(scope[REQUEST_ID])


class Resumable:
    """The resumable streams of one app: each request's `EventLog` by its id, for as long as
    the window keeps it, and the route that reconnects to one."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._logs: dict[str, EventLog] = {}

    def routes(self) -> list[Route]:
        return [
            Route(
                "GET",
                "/v1/streams/",
                Dialect.ANTHROPIC,
                self.reconnect,
                prefix=True,
                header=b"anthropic-version",
            ),
            Route("GET", "/v1/streams/", Dialect.OPENAI, self.reconnect, prefix=True),
        ]

    async def stream(
        self, scope: Scope, send: Send, receive: Receive, reader: Reader, dialect: Dialect
    ) -> None:
        """Stream through a log this connection follows; when it leaves, the generation goes on
        (this returns when it ends) for a reconnect to pick up within the window."""
        stream_id = request_id(scope)
        log = EventLog(stream_id, reader, self.window_s, self._logs.pop)
        self._logs[stream_id] = log

        async def run() -> None:
            try:
                async for data, last_id in frames(reader, dialect):
                    await log.append(data, last_id)
            finally:
                log.close()

        producer = asyncio.ensure_future(run())
        try:
            await log.follow(send, receive, 0, scope=scope)
            await producer
        finally:
            if not producer.done():  # this handler itself was cancelled (the server stops)
                reader.cancel()
                producer.cancel()

    async def reconnect(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """`GET /v1/streams/{id}`: the events after `Last-Event-ID` (all of them without one),
        then the rest as they come."""
        stream_id = path_tail(scope, "/v1/streams/").strip("/")
        log = self._logs.get(stream_id)
        if log is None:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"no stream {stream_id!r} to resume: it never was, or it ended or was dropped "
                f"more than {self.window_s:g} s ago",
            )
        last = header(scope, b"last-event-id") or "0"
        if not last.isdigit():
            raise invalid(f"Last-Event-ID must be an event id (a number), not {last!r}")
        seq = log.replay_from(int(last))
        await log.follow(send, receive, seq, skip_to=int(last) + 1)


@dataclass(frozen=True)
class _Chunk:
    seq: int  # the chunk's place in the log
    first_id: int  # the id of its first event
    next_id: int  # the id after its last event
    data: bytes  # numbered frames


class EventLog:
    """One stream's numbered frames, bounded, followed by at most one connection at a time."""

    def __init__(
        self, stream_id: str, reader: Reader, window_s: float, forget: Callable[[str], object]
    ) -> None:
        self.stream_id = stream_id
        self.reader = reader
        self.window_s = window_s
        self._forget = forget
        self._chunks: deque[_Chunk] = deque()
        self._next_seq = 0
        self.next_id = 1
        self._sent_seq = 0  # the follower's place: chunks before it were handed to a connection
        self._held_bytes = 0
        self._unsent_bytes = 0
        self.closed = False
        self._follower: object | None = None
        self._changed = asyncio.get_running_loop().create_future()
        self._expiry: asyncio.TimerHandle | None = None

    # The producer's side.

    async def append(self, data: bytes, last_id: int) -> None:
        """Add whole numbered frames, the last of them event `last_id`; waits while the log
        holds `BUFFER_BYTES` nobody has been handed."""
        while self._unsent_bytes >= BUFFER_BYTES and not self.closed:
            await self._change()
        self._chunks.append(_Chunk(self._next_seq, self.next_id, last_id + 1, data))
        self._next_seq += 1
        self.next_id = last_id + 1
        self._held_bytes += len(data)
        self._unsent_bytes += len(data)
        self._trim()
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()

    # A connection's side.

    def replay_from(self, last_event_id: int) -> int:
        """The seq to follow from for a client that has the events up to `last_event_id`."""
        if last_event_id >= self.next_id:
            raise invalid(
                f"Last-Event-ID {last_event_id}: stream {self.stream_id} has sent events up to "
                f"{self.next_id - 1}"
            )
        oldest = self._chunks[0].first_id if self._chunks else self.next_id
        if last_event_id + 1 < oldest:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"stream {self.stream_id} no longer holds the events after {last_event_id}",
            )
        for chunk in self._chunks:
            if chunk.next_id > last_event_id + 1:
                return chunk.seq
        return self._next_seq

    async def follow(
        self,
        send: Send,
        receive: Receive,
        seq: int,
        skip_to: int = 0,
        scope: Scope | None = None,
    ) -> None:
        """Answer with the chunks from `seq` on (the first from the event with id `skip_to`),
        then each as it comes, until the stream ends, the client leaves or another connection
        takes the stream over. A connection that leaves starts the window. `scope`: the
        request that started the stream (its headers may be out already)."""
        token = self._attach(seq)
        left = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await start_event_stream(send, scope)
            while self._follower is token and not left.done():
                fresh = self._since(seq)
                if fresh:
                    seq = fresh[-1].seq + 1
                    self._handed(fresh)
                    first = events_after(fresh[0].data, skip_to - 1) if skip_to else fresh[0].data
                    data = b"".join([first, *(c.data for c in fresh[1:])])
                    skip_to = 0
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                elif self.closed:
                    await send(END)
                    return
                else:
                    await asyncio.wait([self._change(), left], return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if self._follower is token:
                self._follower = None
                self._expire_in(self.window_s)

    # The log's own bookkeeping.

    def _attach(self, seq: int) -> object:
        """Make a new connection, reading from `seq`, the one follower."""
        token = object()
        self._follower = token
        self._notify()  # a previous follower sees it is no longer one and returns
        if self._expiry is not None:
            self._expiry.cancel()
        self._sent_seq = seq
        self._unsent_bytes = sum(len(chunk.data) for chunk in self._since(seq))
        return token

    def _since(self, seq: int) -> list[_Chunk]:
        """The chunks from `seq` on (the follower's place is never trimmed)."""
        count = self._next_seq - seq
        return list(islice(reversed(self._chunks), count))[::-1] if count > 0 else []

    def _handed(self, chunks: list[_Chunk]) -> None:
        self._unsent_bytes -= sum(len(chunk.data) for chunk in chunks)
        self._sent_seq = chunks[-1].seq + 1
        self._trim()
        self._notify()

    def _trim(self) -> None:
        """Drop the oldest chunks handed out beyond `BUFFER_BYTES` of them."""
        while self._chunks and self._chunks[0].seq < self._sent_seq:
            if self._held_bytes - self._unsent_bytes <= BUFFER_BYTES:
                break
            self._held_bytes -= len(self._chunks.popleft().data)

    def _change(self) -> asyncio.Future[None]:
        """What resolves at the log's next change (checked state first: it is not queued)."""
        if self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _notify(self) -> None:
        if not self._changed.done():
            self._changed.set_result(None)

    def _expire_in(self, seconds: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        """Nobody came back within the window: end the generation and forget the stream."""
        if self._follower is not None:
            return
        if not self.closed:
            log.info(
                "stream %s: no reconnect within %g s; cancelling it", self.stream_id, self.window_s
            )
        self.reader.cancel()
        self.close()
        self._forget(self.stream_id)
