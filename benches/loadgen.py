"""Streaming load generator: C concurrent clients on the Anthropic or OpenAI chat endpoint.

    .venv/bin/python benches/loadgen.py --url http://127.0.0.1:8080 --dialect anthropic \\
        --concurrency 8 --requests 16 --max-tokens 128

Per request it records the time to response headers, the time to the first content delta
(TTFT), the arrival time of every content delta, and the token counts the server reports in
its usage. Output tokens are the server's count, since neither API can force a model to
ignore its end-of-turn token.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

DIALECTS = ("anthropic", "openai")
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
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


def story_prompt(index: int) -> Prompt:
    """A short prompt (about 70 tokens with the chat template) that makes the model talk long."""
    topic = TOPICS[index % len(TOPICS)]
    return Prompt(
        f"Write a long, detailed story about {topic}. Describe the characters, the places they "
        f"visit, what they say to each other and how the story ends. Use at least five "
        f"paragraphs. This is story number {index + 1}."
    )


@dataclass
class RequestResult:
    index: int
    sent_at: float  # time.monotonic() when the request was sent
    status: int | None = None
    headers_s: float | None = None
    ttft_s: float | None = None
    delta_times: list[float] = field(default_factory=list)  # monotonic arrival of each delta
    output_tokens: int | None = None
    input_tokens: int | None = None  # whole prompt, cached part included
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    closed_early: bool = False  # the client closed the stream on purpose
    ended_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def gaps(self) -> list[float]:
        times = self.delta_times
        return [b - a for a, b in itertools.pairwise(times)]


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"load goes to this machine only; {base_url} is not a loopback address")


def request_body(dialect: str, prompt: Prompt, max_tokens: int, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
    }
    if dialect == "anthropic":
        body["messages"] = [{"role": "user", "content": prompt.user}]
        if prompt.system is not None:
            body["system"] = prompt.system
    elif dialect == "openai":
        system = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
        body["messages"] = [*system, {"role": "user", "content": prompt.user}]
        body["stream_options"] = {"include_usage": True}
    else:
        raise ValueError(f"unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
    return body


def _on_anthropic_event(result: RequestResult, data: dict[str, Any], now: float) -> bool:
    """Apply one Anthropic stream event; True once the stream has properly ended."""
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = data.get("delta", {})
        text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
        if text:
            result.delta_times.append(now)
            result.text += text
    elif kind == "message_start":
        usage = data.get("message", {}).get("usage", {})
        cached = usage.get("cache_read_input_tokens") or 0
        result.input_tokens = (usage.get("input_tokens") or 0) + cached
        result.cached_tokens = cached
    elif kind == "message_delta":
        result.output_tokens = data.get("usage", {}).get("output_tokens")
        result.finish_reason = data.get("delta", {}).get("stop_reason")
    elif kind == "error":
        result.error = f"error event: {data.get('error', {}).get('message', data)}"
        return True
    return kind == "message_stop"


def _on_openai_chunk(result: RequestResult, data: dict[str, Any], now: float) -> None:
    if "error" in data:
        error = data["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        result.error = f"error chunk: {message}"
        return
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
        if text:
            result.delta_times.append(now)
            result.text += text
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if usage := data.get("usage"):
        result.output_tokens = usage.get("completion_tokens")
        result.input_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")


async def stream_one(
    client: httpx.AsyncClient,
    base_url: str,
    dialect: str,
    prompt: Prompt,
    max_tokens: int,
    *,
    index: int = 0,
    model: str = "default_model",
    first_delta: asyncio.Event | None = None,
    close_when: Awaitable[Any] | None = None,
    timeout_s: float | None = None,
) -> RequestResult:
    """Send one streaming request and read it to the end, or close it once `close_when` is done.

    `timeout_s` bounds the whole request; the client's own timeout bounds each wait for bytes.

    `model` defaults to mlx_lm.server's name for the model it was started with; mlxgate
    accepts any name.
    """
    body = request_body(dialect, prompt, max_tokens, model)
    headers = {"anthropic-version": "2023-06-01"} if dialect == "anthropic" else {}
    result = RequestResult(index=index, sent_at=time.monotonic())
    reading = _read_stream(client, base_url, dialect, body, headers, result, first_delta)
    try:
        async with asyncio.timeout(timeout_s):
            if close_when is None:
                await reading
            else:
                result.closed_early = await _read_until(reading, close_when)
    except TimeoutError:
        result.error = f"no complete answer within {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a frame that is not JSON
        result.error = f"{type(exc).__name__}: {exc}"
    result.ended_at = time.monotonic()
    return result


async def _read_until(reading: Awaitable[None], close_when: Awaitable[Any]) -> bool:
    """Run `reading` until it ends or `close_when` is done; True if it was closed early."""
    read_task = asyncio.ensure_future(reading)
    close_task = asyncio.ensure_future(close_when)
    try:
        done, _ = await asyncio.wait({read_task, close_task}, return_when=asyncio.FIRST_COMPLETED)
        if read_task in done:
            read_task.result()  # re-raise what reading raised
            return False
        return True
    finally:
        # Cancelling the reader leaves `client.stream(...)`, which closes the connection.
        for task in (read_task, close_task):
            task.cancel()
        await asyncio.gather(read_task, close_task, return_exceptions=True)


async def _read_stream(
    client: httpx.AsyncClient,
    base_url: str,
    dialect: str,
    body: dict[str, Any],
    headers: dict[str, str],
    result: RequestResult,
    first_delta: asyncio.Event | None,
) -> None:
    url = base_url.rstrip("/") + PATHS[dialect]
    async with client.stream("POST", url, json=body, headers=headers) as response:
        result.status = response.status_code
        result.headers_s = time.monotonic() - result.sent_at
        if response.status_code != 200:
            detail = (await response.aread())[:200].decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {detail}"
            return
        ended = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # `event:` lines repeat the type that the data carries
            now = time.monotonic()
            payload = line[5:].strip()
            if payload == "[DONE]":
                ended = True
                break
            data = json.loads(payload)
            seen = len(result.delta_times)
            if dialect == "anthropic":
                ended = _on_anthropic_event(result, data, now)
            else:
                _on_openai_chunk(result, data, now)
            if seen == 0 and result.delta_times:
                result.ttft_s = now - result.sent_at
                if first_delta is not None:
                    first_delta.set()
            if ended or result.error:
                break
        if not ended and result.error is None:
            result.error = "stream ended early (no end-of-stream event)"
        elif result.output_tokens is None and result.error is None:
            result.error = "no usage with the output token count"


@dataclass
class LoadRun:
    results: list[RequestResult]
    wall_s: float


def make_client(concurrency: int, stall_s: float) -> httpx.AsyncClient:
    """A client whose requests fail after `stall_s` without a byte from the server."""
    # trust_env=False: a proxy from the environment must never see benchmark traffic.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(stall_s, connect=10.0),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency),
        trust_env=False,
    )


async def run_load(
    base_url: str,
    dialect: str,
    prompts: Sequence[Prompt],
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
    model: str = "default_model",
    timeout_s: float = 1800.0,
    stall_s: float = 600.0,
) -> LoadRun:
    """`requests` requests (prompt i % len(prompts)), at most `concurrency` in flight.

    Each request fails after `timeout_s` in all, or after `stall_s` without a byte.
    """
    check_loopback(base_url)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            result = await stream_one(
                client,
                base_url,
                dialect,
                prompts[i % len(prompts)],
                max_tokens,
                index=i,
                model=model,
                timeout_s=timeout_s,
            )
            results.append(result)

    async with make_client(concurrency, stall_s) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall_s = time.monotonic() - started
    results.sort(key=lambda r: r.index)
    return LoadRun(results, wall_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


# Goodput's service-level objective: a reply starts within TTFT_SLO_S and then takes at most
# TPOT_SLO_S per token on average.
TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.25


def _decode_s(r: RequestResult) -> float | None:
    """Seconds from a reply's first token to its last."""
    return None if r.ttft_s is None else r.ended_at - r.sent_at - r.ttft_s


def _meets_slo(r: RequestResult) -> bool:
    decode_s = _decode_s(r)
    if decode_s is None or r.ttft_s is None or r.ttft_s > TTFT_SLO_S:
        return False
    return decode_s <= TPOT_SLO_S * max(1, (r.output_tokens or 1) - 1)


def summarize(run: LoadRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    decoding = [(r.output_tokens - 1, _decode_s(r) or 0.0) for r in ok if r.output_tokens]
    decode_s = sum(s for _, s in decoding)
    first_sent = min((r.sent_at for r in run.results), default=0.0)
    gaps = [g for r in ok for g in r.gaps]
    output = sum(r.output_tokens or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in run.results:
        if r.error:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "errors": errors,
        "wall_s": run.wall_s,
        "output_tokens": output,
        "output_tok_s": output / run.wall_s if run.wall_s > 0 else 0.0,
        # Per request, after its first token (prefill left out), over all requests.
        "decode_tok_s": sum(n for n, _ in decoding) / decode_s if decode_s > 0 else 0.0,
        "goodput_tok_s": sum(r.output_tokens or 0 for r in ok if _meets_slo(r)) / run.wall_s
        if run.wall_s > 0
        else 0.0,
        "mean_output_tokens": output / len(ok) if ok else 0.0,
        "mean_input_tokens": statistics.mean(r.input_tokens or 0 for r in ok) if ok else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        # Per request, in the order sent: when (seconds after the first) and its TTFT (None if
        # it failed), to see where a tail comes from.
        "sent_s": [round(r.sent_at - first_sent, 3) for r in run.results],
        "ttfts_s": [None if r.ttft_s is None else round(r.ttft_s, 3) for r in run.results],
        "itl_p50_s": percentile(gaps, 50),
        "itl_p95_s": percentile(gaps, 95),
        "itl_max_s": max(gaps) if gaps else None,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"requests {s['requests']}, failed {s['failed']}, wall {s['wall_s']:.1f} s",
        f"output {s['output_tokens']} tokens, {s['output_tok_s']:.1f} tok/s aggregate "
        f"(mean {s['mean_output_tokens']:.0f} out / {s['mean_input_tokens']:.0f} in per request)",
        f"TTFT p50 {_ms(s['ttft_p50_s'])} ms, p95 {_ms(s['ttft_p95_s'])} ms",
        f"inter-token p50 {_ms(s['itl_p50_s'])} ms, p95 {_ms(s['itl_p95_s'])} ms, "
        f"max {_ms(s['itl_max_s'])} ms",
    ]
    lines += [f"  {count} x {error}" for error, count in s["errors"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--dialect", choices=DIALECTS, default="anthropic")
    parser.add_argument("--concurrency", "-c", type=int, default=1)
    parser.add_argument("--requests", "-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="default_model")
    parser.add_argument("--prompt", help="one user prompt for every request (default: stories)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    parser.add_argument("--stall", type=float, default=600.0, help="seconds without a byte")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    prompts = (
        [Prompt(args.prompt)] if args.prompt else [story_prompt(i) for i in range(args.requests)]
    )
    run = asyncio.run(
        run_load(
            args.url,
            args.dialect,
            prompts,
            concurrency=args.concurrency,
            requests=args.requests,
            max_tokens=args.max_tokens,
            model=args.model,
            timeout_s=args.timeout,
            stall_s=args.stall,
        )
    )
    summary = summarize(run)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


if __name__ == "__main__":
    main()
