"""The agent-trace scenario: recorded agent sessions (`mlxgate.trace`) replayed against a
target, N sessions at once, each turn sent when the session's previous response has ended and
the recorded time between turns has passed (the agent's own work: tools, thinking)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mlxgate.bench.client import send
from mlxgate.bench.load import check_loopback, make_client
from mlxgate.bench.records import PATHS, Record
from mlxgate.trace import Turn

DIALECT_OF = {path: dialect for dialect, path in PATHS.items()}


def replayable(turn: Turn, model: str | None) -> tuple[str, dict[str, Any]]:
    """A recorded turn's dialect and body as it is sent again: the target's model name if one
    is given, and an OpenAI stream asks for its usage (the token count)."""
    dialect = DIALECT_OF[turn.path]
    body = dict(turn.body)
    if model is not None:
        body["model"] = model
    if dialect == "openai" and body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return dialect, body


async def replay(
    url: str,
    recorded: list[list[Turn]],
    sessions: int,
    *,
    model: str | None = None,
    timeout_s: float = 1800.0,
    stall_s: float = 600.0,
    on_done: Callable[[Record], object] = lambda _: None,
) -> list[Record]:
    """`sessions` sessions at once, session k replaying recorded session k % len(recorded)."""
    check_loopback(url)

    async def session(number: int, turns: list[Turn]) -> list[Record]:
        records = []
        for turn in turns:
            if turn.after_s:
                await asyncio.sleep(turn.after_s)
            dialect, body = replayable(turn, model)
            record = Record(index=turn.turn, dialect=dialect, sent_at=0.0, session=str(number))
            await send(client, url, record, body, timeout_s=timeout_s)
            records.append(record)
            on_done(record)
        return records

    async with make_client(sessions, stall_s) as client:
        done = await asyncio.gather(
            *(session(k, recorded[k % len(recorded)]) for k in range(sessions))
        )
    return [record for records in done for record in records]
