"""Load: the prompts a benchmark sends, each dialect's request body, and the two ways requests
arrive: a closed loop of C clients (each sends its next request when its last one ends) or an
open loop at a Poisson rate (requests arrive on their own clock, however the server keeps up)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from mlxgate.bench.client import send
from mlxgate.bench.records import DIALECTS, Record

LOOPBACK = ("127.0.0.1", "localhost", "::1")

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "two rival bakers in a small mountain town",
    "a robot learning to paint landscapes",
    "a sailor lost in a storm near an unknown island",
    "a girl who can talk to the trees in her garden",
    "an old clockmaker and his last commission",
    "a detective solving a mystery on a night train",
    "a family moving to a farm after years in the city",
    "a young astronaut's first walk on the moon",
    "a dragon who is afraid of the dark",
    "a musician who loses her voice before a big concert",
    "a village that wakes up to find the river gone",
    "a librarian who discovers a book that writes itself",
    "a chess champion and a mysterious stranger",
    "a fox and a crow who become unlikely friends",
    "a scientist who builds a time machine by accident",
)


@dataclass(frozen=True)
class Prompt:
    user: str
    system: str | None = None
    images: tuple[str, ...] = ()  # data: URLs of images shown before the text


def story_prompt(index: int) -> Prompt:
    """A short prompt (about 70 tokens with the chat template) that makes the model talk long."""
    topic = TOPICS[index % len(TOPICS)]
    return Prompt(
        f"Write a long, detailed story about {topic}. Describe the characters, the places they "
        f"visit, what they say to each other and how the story ends. Use at least five "
        f"paragraphs. This is story number {index + 1}."
    )


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"load goes to this machine only; {base_url} is not a loopback address")


def request_body(
    dialect: str, prompt: Prompt, max_tokens: int, model: str, *, stream: bool = True
) -> dict[str, Any]:
    """A greedy request for `prompt` in `dialect`, streamed with usage unless `stream` is off."""
    body: dict[str, Any] = {"model": model, "stream": stream, "temperature": 0.0}
    system = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
    user = [{"role": "user", "content": _content(dialect, prompt)}]
    if dialect == "anthropic":
        body |= {"max_tokens": max_tokens, "messages": user}
        if prompt.system is not None:
            body["system"] = prompt.system
    elif dialect == "openai":
        body |= {"max_tokens": max_tokens, "messages": system + user}
        if stream:
            body["stream_options"] = {"include_usage": True}
    elif dialect == "responses":
        body |= {"max_output_tokens": max_tokens, "input": user}
        if prompt.system is not None:
            body["instructions"] = prompt.system
    else:
        raise ValueError(f"unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
    return body


def _content(dialect: str, prompt: Prompt) -> str | list[dict[str, Any]]:
    """The user turn's content in `dialect`'s shape: its text, after its images if any."""
    if not prompt.images:
        return prompt.user
    parts: list[dict[str, Any]] = []
    for url in prompt.images:
        if dialect == "anthropic":
            media_type, data = url.removeprefix("data:").split(";base64,")
            source = {"type": "base64", "media_type": media_type, "data": data}
            parts.append({"type": "image", "source": source})
        elif dialect == "openai":
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "input_image", "image_url": url})
    text_type = "input_text" if dialect == "responses" else "text"
    return [*parts, {"type": text_type, "text": prompt.user}]


def make_client(concurrency: int, stall_s: float) -> httpx.AsyncClient:
    """A client whose requests fail after `stall_s` without a byte from the server."""
    # trust_env=False: a proxy from the environment must never see benchmark traffic.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(stall_s, connect=10.0),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency),
        trust_env=False,
    )


async def send_prompt(
    client: httpx.AsyncClient,
    base_url: str,
    dialect: str,
    prompt: Prompt,
    max_tokens: int,
    *,
    index: int = 0,
    model: str = "default_model",
    first_token: asyncio.Event | None = None,
    close_when: Awaitable[Any] | None = None,
    timeout_s: float | None = None,
) -> Record:
    """Send `prompt` as one greedy streamed request and read it into a new record, to its end or
    until `close_when` is done (`client.send`). `model` defaults to mlx_lm.server's name for
    the model it was started with; mlxgate accepts any name."""
    record = Record(index=index, dialect=dialect, sent_at=time.monotonic())
    body = request_body(dialect, prompt, max_tokens, model)
    return await send(
        client, base_url, record, body, close_when=close_when, first_token=first_token,
        timeout_s=timeout_s,
    )  # fmt: skip


@dataclass(frozen=True)
class Load:
    """What one run sends: `requests` requests (request i asks with `prompt(i)`), at most
    `concurrency` at a time, arriving at `rate` a second (Poisson) or, without a rate, each
    client's next as soon as its last ends."""

    url: str
    dialect: str
    requests: int
    concurrency: int
    max_tokens: int
    model: str = "default_model"
    rate: float | None = None
    prompt: Callable[[int], Prompt] = story_prompt
    timeout_s: float = 1800.0  # a request fails after this long in all
    stall_s: float = 600.0  # or after this long without a byte
    seed: int = 0


async def run(load: Load, on_done: Callable[[Record], object] = lambda _: None) -> list[Record]:
    """Send `load`; `on_done` sees each record as its request ends (a progress bar)."""
    check_loopback(load.url)
    records: list[Record] = []
    slots = asyncio.Semaphore(load.concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with slots:
            record = await send_prompt(
                client, load.url, load.dialect, load.prompt(index), load.max_tokens,
                index=index, model=load.model, timeout_s=load.timeout_s,
            )  # fmt: skip
        records.append(record)
        on_done(record)

    async with make_client(load.concurrency, load.stall_s) as client:
        if load.rate is None:
            await asyncio.gather(*(one(client, i) for i in range(load.requests)))
        else:
            arrivals = random.Random(load.seed)
            tasks = []
            for i in range(load.requests):
                tasks.append(asyncio.ensure_future(one(client, i)))
                await asyncio.sleep(arrivals.expovariate(load.rate))
            await asyncio.gather(*tasks)
    records.sort(key=lambda r: r.index)
    return records
