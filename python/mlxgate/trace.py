"""Agent traces: the requests of recorded agent sessions, as JSONL, for `mlxgate bench` to replay
with their real timing (`mlxgate serve --record-trace FILE` writes them).

One line per generation request:

    {"session": "<id>", "turn": 0, "at_s": 0.0, "after_s": null,
     "path": "/v1/messages", "body": {...}}

`session` is the client's session id (Claude Code's `X-Claude-Code-Session-Id`, Codex's
`session_id` header; else the client's address), `turn` counts a session's requests from 0,
`at_s` is the request's arrival after the session's first, `after_s` the time since the
session's previous response ended (the client's own time between turns: tools, thinking; null
for the first), `path` the route and `body` the request as sent."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The headers agents name their session in, in the order they are looked for.
SESSION_HEADERS = (b"x-claude-code-session-id", b"session_id", b"session-id", b"conversation_id")


@dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    at_s: float
    after_s: float | None
    path: str
    body: dict[str, Any]


def read(path: Path) -> list[Turn]:
    """A trace's turns, in the order they were recorded."""
    with path.open() as lines:
        return [Turn(**json.loads(line)) for line in lines if line.strip()]


def sessions(turns: list[Turn]) -> list[list[Turn]]:
    """Each session's turns in order, sessions in the order they began."""
    by_session: dict[str, list[Turn]] = {}
    for turn in turns:
        by_session.setdefault(turn.session, []).append(turn)
    return [sorted(group, key=lambda t: t.turn) for group in by_session.values()]


class Recorder:
    """Appends each generation request to a trace file as it arrives (the server's side)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)  # a line at a time: a crash loses none
        self._lock = threading.Lock()
        # Per session: its first arrival, the turns so far, when its last response ended.
        self._sessions: dict[str, tuple[float, int, float | None]] = {}

    def started(self, session: str, path: str, body: bytes) -> None:
        now = time.monotonic()
        try:
            request = json.loads(body)
        except ValueError:
            return  # refused with a 400 anyway: nothing to replay
        with self._lock:
            first, turns, ended = self._sessions.get(session, (now, 0, None))
            turn = Turn(
                session,
                turns,
                round(now - first, 4),
                None if ended is None else round(now - ended, 4),
                path,
                request,
            )
            self._sessions[session] = (first, turns + 1, None)
            self._file.write(json.dumps(asdict(turn)) + "\n")

    def ended(self, session: str) -> None:
        with self._lock:
            if session in self._sessions:
                first, turns, _ = self._sessions[session]
                self._sessions[session] = (first, turns, time.monotonic())


def session_of(headers: list[tuple[bytes, bytes]], client: str) -> str:
    """The session a request belongs to: the first session header it has, else its client."""
    found = dict(headers)
    for name in SESSION_HEADERS:
        if value := found.get(name):
            return bytes(value).decode("latin-1")
    return f"client:{client}"
