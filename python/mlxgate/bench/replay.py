"""The agent-trace scenario: recorded agent sessions (`mlxgate.trace`) replayed against a
target, N sessions at once, each turn sent when the session's previous response has ended and
the recorded time between turns has passed (the agent's own work: tools, thinking). A turn that
arrived while an earlier one was still running (Claude Code's side calls: a title, a summary)
is sent as long after that one as it was, beside it. A target that speaks only chat
completions (`trace=chat`) gets every turn as one (`to_chat`), whatever API it was recorded in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from mlxgate.bench.client import send
from mlxgate.bench.load import check_loopback, make_client
from mlxgate.bench.records import PATHS, Record
from mlxgate.bench.to_chat import to_chat
from mlxgate.trace import Turn

DIALECT_OF = {path: dialect for dialect, path in PATHS.items()}


# Where each dialect's body says how many tokens the reply may have.
MAX_TOKENS = {"anthropic": "max_tokens", "openai": "max_tokens", "responses": "max_output_tokens"}


def replayable(
    turn: Turn, model: str | None, max_tokens: int | None = None, *, chat: bool = False
) -> tuple[str, dict[str, Any]]:
    """A recorded turn's dialect and body as it is sent again: as a chat completion if `chat`,
    with the target's model name if one is given, the reply held to `max_tokens` (agents ask
    for up to 128,000; a model other than the recorded one may take them all), and an OpenAI
    stream asks for its usage."""
    dialect = DIALECT_OF[turn.path]
    body = dict(turn.body)
    if chat:
        dialect, body = "openai", to_chat(dialect, body)
    if model is not None:
        body["model"] = model
    if max_tokens is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else MAX_TOKENS[dialect]
        body[key] = min(body.get(key) or max_tokens, max_tokens)
    if dialect == "openai" and body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return dialect, body


async def replay(
    url: str,
    recorded: list[list[Turn]],
    sessions: int,
    *,
    model: str | None = None,
    max_tokens: int | None = None,
    chat: bool = False,
    timeout_s: float = 1800.0,
    stall_s: float = 600.0,
    staggered: bool = False,
    on_done: Callable[[Record], object] = lambda _: None,
) -> list[Record]:
    """`sessions` sessions at once, session k replaying recorded session k % len(recorded);
    every turn as a chat completion if `chat`; `staggered`, each session once the one before has
    its first answer (its first turn, a long prompt, then prefills beside the others' next
    turns)."""
    check_loopback(url)
    # Each recorded turn made ready once, before the clock starts: not per session, and not on
    # the event loop while other sessions' streams are being timed.
    ready = [
        [replayable(turn, model, max_tokens, chat=chat) for turn in turns] for turns in recorded
    ]

    async def one(number: int, turn: Turn, dialect: str, body: dict[str, Any]) -> Record:
        record = Record(index=turn.turn, dialect=dialect, sent_at=0.0, session=str(number))
        await send(client, url, record, body, timeout_s=timeout_s)
        on_done(record)
        return record

    # Set once each session's first turn has its answer.
    answered = [asyncio.Event() for _ in range(sessions)]

    async def session(
        number: int, turns: list[Turn], bodies: list[tuple[str, dict[str, Any]]]
    ) -> list[Record]:
        if staggered and number:
            await answered[number - 1].wait()
        in_flight: list[asyncio.Future[Record]] = []
        done: list[Record] = []
        previous: tuple[float, float] | None = None  # the last send: (our clock, its at_s)
        for turn, (dialect, body) in zip(turns, bodies, strict=True):
            if previous is not None and turn.after_s is None:
                # It came while the previous request was still running (a side call): it goes
                # as long after that one's send as it did, without waiting for its answer.
                sent, at_s = previous
                await asyncio.sleep(max(0.0, turn.at_s - at_s - (time.monotonic() - sent)))
            else:
                done += await asyncio.gather(*in_flight)
                in_flight = []
                if turn.after_s:
                    await asyncio.sleep(turn.after_s)
            previous = (time.monotonic(), turn.at_s)
            in_flight.append(asyncio.ensure_future(one(number, turn, dialect, body)))
            if turn is turns[0]:
                in_flight[-1].add_done_callback(lambda _: answered[number].set())
        return done + list(await asyncio.gather(*in_flight))

    async with make_client(sessions, stall_s) as client:
        done = await asyncio.gather(
            *(
                session(k, recorded[k % len(recorded)], ready[k % len(recorded)])
                for k in range(sessions)
            )
        )
    return [record for records in done for record in records]
