"""Sending one benchmark request and reading its answer into a `Record`, the time of every
token frame taken as it arrives."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx

from mlxgate.bench.records import PATHS, Record, Tally


async def sse_frames(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """(event, data) per SSE frame; `id:` lines and comments are skipped, data lines joined."""
    event: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data:
        yield event, "\n".join(data)


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    record: Record,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    close_when: Awaitable[Any] | None = None,
    first_token: asyncio.Event | None = None,
    timeout_s: float | None = None,
) -> Record:
    """Send `body` to the record's dialect's route and read the answer into `record`, to its
    end, or until `close_when` is done (then the client closes the stream: `closed_early`).
    `first_token` is set when the first token arrives. `timeout_s` bounds the whole request;
    the client's own timeout bounds each wait for bytes."""
    url = base_url.rstrip("/") + PATHS[record.dialect]
    if record.dialect == "anthropic":
        headers = {"anthropic-version": "2023-06-01", **(headers or {})}
    record.sent_at = time.monotonic()
    reading = asyncio.ensure_future(_read(client, url, record, body, headers or {}, first_token))
    closing = asyncio.ensure_future(close_when) if close_when is not None else None
    try:
        async with asyncio.timeout(timeout_s):
            waiting = {reading} if closing is None else {reading, closing}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if reading in done:
                reading.result()  # what reading raised
            else:
                record.closed_early = True
    except TimeoutError:
        record.fail("timeout", f"no whole answer within {timeout_s:.0f} s")
    except httpx.HTTPError as exc:
        record.fail("transport", f"{type(exc).__name__}: {exc}")
    finally:
        # Cancelling the reader leaves `client.stream(...)`, which closes the connection.
        for task in (reading, closing):
            if task is not None:
                task.cancel()
        await asyncio.gather(reading, *([closing] if closing else []), return_exceptions=True)
    record.ended_at = time.monotonic()
    return record


async def _read(
    client: httpx.AsyncClient,
    url: str,
    record: Record,
    body: dict[str, Any],
    headers: dict[str, str],
    first_token: asyncio.Event | None,
) -> None:
    tally = Tally(record)
    async with client.stream("POST", url, json=body, headers=headers) as response:
        record.status = response.status_code
        record.headers_s = time.monotonic() - record.sent_at
        if response.status_code != 200:
            detail = (await response.aread())[:200].decode(errors="replace")
            record.fail("http", f"HTTP {response.status_code}: {detail}")
            return
        if not body.get("stream"):
            try:
                tally.body(json.loads(await response.aread()))
            except ValueError:
                record.fail("bad_frame", "the body is not JSON")
                return
        else:
            async for event, data in sse_frames(response.aiter_lines()):
                now = time.monotonic()
                try:
                    parsed = data if data == "[DONE]" else json.loads(data)
                except ValueError:
                    record.fail("bad_frame", f"a frame's data is not JSON: {data[:80]}")
                    return
                tally.frame(event, parsed, now)
                if first_token is not None and record.delta_times:
                    first_token.set()
                if tally.ended:
                    break
    if not tally.ended:
        record.fail("truncated", "the stream ended without its end event")
    elif record.ok and record.output_tokens is None:
        record.fail("truncated", "no usage with the output token count")
