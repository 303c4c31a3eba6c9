"""Soak run: a long mixed load on one fresh mlxgate server (loopback only), to show that nothing
fails, memory stays flat and latency does not drift.

    .venv/bin/python benches/soak.py                      # 30 minutes, 6 clients
    .venv/bin/python benches/soak.py --minutes 3 --window-minutes 1    # a smoke run

The clients loop over a mix: streams in the Anthropic, OpenAI and Responses dialects, whole
(non-streamed) answers, streams cancelled at a random point, a client that never reads its
stream, malformed requests (each must get a 4xx), agents that share a long system prompt (the
prefix cache's case) and streams cut and resumed (`--resume-window`). Every 10 s it samples the
server's RSS (its process tree), the prefix cache's bytes and the engine's open streams.

Reported (printed, and written to benches/results/soak-<timestamp>.md and .json): requests and
failures by kind, RSS growth after the warm-up (the first window), ITL p95 per window and its
drift from the first window after the warm-up, and the open streams once the load stops (must
be 0). Never run it beside tests or another benchmark: it measures latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from report import publish

from mlxgate.bench.client import send
from mlxgate.bench.figures import percentile
from mlxgate.bench.load import (
    Prompt,
    check_loopback,
    make_client,
    request_body,
    send_prompt,
    story_prompt,
)
from mlxgate.bench.machine import rss_mb
from mlxgate.bench.records import Record
from mlxgate.bench.spawn import Server, free_port, mlxgate_command

ROOT = Path(__file__).resolve().parent.parent

RESUME_WINDOW_S = 10
WARM_UP_WINDOWS = 2  # the prefix cache (1 GB) and MLX's buffer cache fill in about 10 minutes
SAMPLE_EVERY_S = 10.0
AGENT_SYSTEM = "You are a careful coding agent working in a large repository. " + " ".join(
    f"Rule {i}: read the file before you change it, keep the change small, run the tests "
    f"for module number {i} and report what you changed in one short paragraph."
    for i in range(40)
)  # about 1,500 tokens, the same for every agent: the prefix cache serves it
AGENT_TASKS = (
    "Rename the function parse_args to parse_arguments everywhere.",
    "Add a docstring to the class Config.",
    "Explain what the module scheduler does.",
    "Find where the cache is cleared and say why.",
)
# (kind, weight): how often each kind of request is in the mix.
MIX = (
    ("stream_anthropic", 18),
    ("stream_openai", 14),
    ("stream_responses", 10),
    ("whole", 10),
    ("cancelled", 14),
    ("agent", 16),
    ("malformed", 10),
    ("resumed", 6),
    ("never_reading", 2),
)
MALFORMED = (
    ("/v1/messages", b"{not json"),
    ("/v1/messages", b'{"model": "m", "max_tokens": "many", "messages": []}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"model": "m", "max_tokens": -3, "messages": []}'),
    ("/v1/responses", b'{"model": "m", "input": [{"type": "no_such_item"}]}'),
    (
        "/v1/messages",
        b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", '
        b'"content": [{"type": "hologram"}]}]}',
    ),
)


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    failure: str | None = None  # why it failed, if it did
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (arrival, ITL)


@dataclass
class Sample:
    at_s: float
    rss_mb: float
    prefix_cache_mb: float
    mlx_active_mb: float  # live arrays
    mlx_cache_mb: float  # MLX's pool of freed buffers
    open_streams: int
    running: int
    heap_trims: int  # times the server gave free heap pages back (engine/heap.py)
    heap_trim_s: float
    # The engine's counters, for its step time and decode rate per window.
    steps: int
    busy_s: float
    decode_tokens: int
    # A fixed computation in this process, timed in CPU time: the machine's own speed, which
    # drifts (a slower window with a slower probe is the machine, not the server).
    probe_ms: float


class Soak:
    def __init__(
        self, url: str, command: list[str], minutes: float, clients: int, seed: int
    ) -> None:
        self.url = url
        self.command = command
        self.deadline = time.monotonic() + minutes * 60
        self.started = time.monotonic()
        self.clients = clients
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.samples: list[Sample] = []
        self.first_agent_done = float("inf")  # from then on, agents' prompts must be cached

    async def run(self, server_pid: int) -> None:
        sampler = asyncio.ensure_future(self._sample_loop(server_pid))
        async with make_client(self.clients * 2, stall_s=600) as client:
            await asyncio.gather(*(self._client_loop(client, i) for i in range(self.clients)))
        sampler.cancel()

    async def _client_loop(self, client: httpx.AsyncClient, number: int) -> None:
        kinds, weights = zip(*MIX, strict=True)
        count = 0
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(kinds, weights)[0]
            count += 1
            outcome = Outcome(kind, time.monotonic(), 0.0)
            try:
                n = number * 100_000 + count
                if kind.startswith("stream_"):
                    await self._stream(client, outcome, n, kind.removeprefix("stream_"))
                else:
                    await getattr(self, f"_{kind}")(client, outcome, n)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                outcome.failure = f"{type(exc).__name__}: {exc}"[:200]
            outcome.ended = time.monotonic()
            self.outcomes.append(outcome)

    # The kinds of request.

    def _record(self, outcome: Outcome, result: Record) -> None:
        if result.error is not None:
            outcome.failure = result.error[:200]
        outcome.gaps = [(t, g) for t, g in zip(result.delta_times[1:], result.gaps, strict=True)]

    async def _stream(
        self, client: httpx.AsyncClient, outcome: Outcome, n: int, dialect: str
    ) -> None:
        result = await send_prompt(
            client, self.url, dialect, story_prompt(n), 96, model="m", timeout_s=600
        )
        self._record(outcome, result)

    async def _agent(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        prompt = Prompt(AGENT_TASKS[n % len(AGENT_TASKS)], system=AGENT_SYSTEM)
        result = await send_prompt(
            client, self.url, "anthropic", prompt, 64, model="m", timeout_s=600
        )
        self._record(outcome, result)
        if result.error is None:
            if not result.cached_tokens and outcome.started > self.first_agent_done:
                outcome.failure = "an agent's shared system prompt was not served from the cache"
            self.first_agent_done = min(self.first_agent_done, time.monotonic())

    async def _cancelled(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        dialect = self.rng.choice(("anthropic", "openai"))
        result = await send_prompt(
            client,
            self.url,
            dialect,
            story_prompt(n),
            200,
            model="m",
            close_when=asyncio.sleep(self.rng.uniform(0.05, 3.0)),
            timeout_s=600,
        )
        self._record(outcome, result)

    async def _whole(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        dialect = self.rng.choice(("anthropic", "openai"))
        body = request_body(dialect, story_prompt(n), 48, "m", stream=False)
        record = Record(index=n, dialect=dialect, sent_at=time.monotonic())
        self._record(outcome, await send(client, self.url, record, body, timeout_s=600))

    async def _malformed(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        path, body = MALFORMED[n % len(MALFORMED)]
        response = await client.post(
            self.url + path, content=body, headers={"content-type": "application/json"}
        )
        if not 400 <= response.status_code < 500 or "error" not in response.json():
            outcome.failure = f"malformed request answered {response.status_code}"

    async def _never_reading(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        body = request_body("anthropic", story_prompt(n), 400, "m")
        async with client.stream("POST", self.url + "/v1/messages", json=body) as response:
            if response.status_code != 200:
                outcome.failure = f"HTTP {response.status_code}"
                return
            await asyncio.sleep(20)  # holds the connection, reads nothing

    async def _resumed(self, client: httpx.AsyncClient, outcome: Outcome, n: int) -> None:
        body = request_body("anthropic", story_prompt(n), 96, "m")
        frames = b""
        async with client.stream("POST", self.url + "/v1/messages", json=body) as response:
            if response.status_code != 200:
                outcome.failure = f"HTTP {response.status_code}"
                return
            stream_id = response.headers["request-id"]
            async for chunk in response.aiter_raw():
                frames += chunk
                if frames.count(b"\n\n") >= self.rng.randint(3, 12):
                    break
        whole = frames[: frames.rfind(b"\n\n") + 2]
        last = whole.rsplit(b"\nid: ", 1)[-1] if b"\nid: " in whole else whole[4:]
        last_id = last[: last.index(b"\n")].decode()
        resumed = await client.get(
            self.url + f"/v1/streams/{stream_id}", headers={"last-event-id": last_id}
        )
        text = (whole + resumed.content).decode()
        ids = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
        if resumed.status_code != 200:
            outcome.failure = f"resume answered {resumed.status_code}"
        elif ids != list(range(1, len(ids) + 1)) or "event: message_stop" not in text:
            outcome.failure = "a resumed stream lost or repeated events"

    # Sampling the server.

    async def _sample_loop(self, pid: int) -> None:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            while True:
                self.samples.append(await sample(client, self.url, pid, self.started))
                await asyncio.sleep(SAMPLE_EVERY_S)


def metrics(text: str) -> dict[str, float]:
    """Each metric's (first) value in a Prometheus text exposition."""
    return {
        family.name: family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.samples
    }


async def sample(client: httpx.AsyncClient, url: str, pid: int, started: float) -> Sample:
    scraped = metrics((await client.get(url + "/metrics")).text)
    return Sample(
        at_s=round(time.monotonic() - started, 1),
        rss_mb=round(rss_mb(pid), 1),
        prefix_cache_mb=round(scraped["mlxgate_prefix_cache_bytes"] / 2**20, 1),
        mlx_active_mb=round(scraped["mlxgate_mlx_active_bytes"] / 2**20, 1),
        mlx_cache_mb=round(scraped["mlxgate_mlx_cache_bytes"] / 2**20, 1),
        open_streams=int(scraped["mlxgate_engine_open_streams"]),
        running=int(scraped["mlxgate_engine_running"]),
        heap_trims=int(scraped["mlxgate_engine_heap_trims"]),
        heap_trim_s=round(scraped["mlxgate_engine_heap_trim_s"], 3),
        steps=int(scraped["mlxgate_engine_steps"]),
        busy_s=scraped["mlxgate_engine_busy_s"],
        decode_tokens=int(scraped["mlxgate_engine_decode_tokens"]),
        probe_ms=round(probe_ms(), 2),
    )


def probe_ms() -> float:
    """CPU time (not wall time: the server's threads share the cores) of a fixed computation,
    the fastest of three: it grows when the machine itself is slower."""
    times = []
    for _ in range(3):
        started = time.thread_time()
        sum(i * i for i in range(100_000))
        times.append(time.thread_time() - started)
    return 1000 * min(times)


def windows(soak: Soak, window_s: float) -> list[dict[str, Any]]:
    """Per window of the run: requests, failures, ITL p95, RSS (median and peak) and MLX's
    buffer cache (median)."""
    out = []
    total = max(o.ended for o in soak.outcomes) - soak.started
    for i in range(max(1, round(total / window_s))):
        lo, hi = soak.started + i * window_s, soak.started + (i + 1) * window_s
        gaps = [g for o in soak.outcomes for t, g in o.gaps if lo <= t < hi]
        ended = [o for o in soak.outcomes if lo <= o.ended < hi]
        inside = [s for s in soak.samples if lo - soak.started <= s.at_s < hi - soak.started]
        first, last = (inside[0], inside[-1]) if inside else (None, None)
        engine: dict[str, Any] = {}
        if first is not None and last is not None and last.steps > first.steps:
            engine = {
                "step_ms": round(
                    1000 * (last.busy_s - first.busy_s) / (last.steps - first.steps), 1
                ),
                "decode_tok_s": round(
                    (last.decode_tokens - first.decode_tokens) / (last.at_s - first.at_s), 1
                ),
                "running": round(statistics.fmean(s.running for s in inside), 2),
                "probe_ms": statistics.median(s.probe_ms for s in inside),
            }
        out.append(
            {
                "window": i + 1,
                "requests": len(ended),
                "failures": sum(o.failure is not None for o in ended),
                "itl_p95_ms": round(1000 * (percentile(gaps, 95) or 0), 1),
                "rss_mb": statistics.median(s.rss_mb for s in inside) if inside else None,
                "rss_max_mb": max((s.rss_mb for s in inside), default=None),
                "mlx_cache_mb": statistics.median(s.mlx_cache_mb for s in inside)
                if inside
                else None,
                **engine,
            }
        )
    return out


async def drain_check(url: str, pid: int, started: float) -> Sample:
    """The server once the load has stopped: waits (up to the resume window and a margin) for
    every stream to be let go."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        deadline = time.monotonic() + RESUME_WINDOW_S + 30
        while True:
            after = await sample(client, url, pid, started)
            if (after.open_streams == 0 and after.running == 0) or time.monotonic() > deadline:
                return after
            await asyncio.sleep(1)


def report(soak: Soak, window_s: float, after: Sample, args: argparse.Namespace) -> Path:
    per_window = windows(soak, window_s)
    steady = per_window[WARM_UP_WINDOWS:]
    base, last = steady[0], steady[-1]
    rss_growth = (last["rss_mb"] - base["rss_mb"]) / base["rss_mb"]
    peak_rss = max(w["rss_max_mb"] for w in steady)
    drift = max(abs(w["itl_p95_ms"] / base["itl_p95_ms"] - 1) for w in steady)
    failures = Counter(o.failure.split(":")[0] for o in soak.outcomes if o.failure)
    kinds = Counter(o.kind for o in soak.outcomes)
    failed_kinds = Counter(o.kind for o in soak.outcomes if o.failure)
    lines = [
        f"# Soak: {args.minutes:g} minutes, {args.clients} clients, mixed load",
        "",
        f"`{' '.join(sys.argv)}`, server `{' '.join(soak.command)}`.",
        "",
        f"- requests: {len(soak.outcomes)}, unexpected failures: {sum(failures.values())}",
        f"- warm-up: the first {WARM_UP_WINDOWS} windows (the prefix cache and MLX's buffer "
        "cache fill); after it:",
        f"- RSS (median per window) {base['rss_mb']:.0f} MB in window {base['window']}, "
        f"{last['rss_mb']:.0f} MB in window {last['window']}: growth {100 * rss_growth:+.1f}% "
        f"(must stay under 5%); the highest sample {peak_rss:.0f} MB",
        f"- ITL p95 drift from window {base['window']} over the later windows: "
        f"{100 * drift:.1f}% (must stay under 10%)",
        f"- after the load: {after.open_streams} open streams, {after.running} running "
        f"(must be 0), prefix cache {after.prefix_cache_mb:.0f} MB, MLX's live arrays "
        f"{after.mlx_active_mb:.0f} MB",
        f"- free heap pages given back {after.heap_trims} times, in "
        f"{after.heap_trim_s:.2f} s all told",
        "",
        "| kind | requests | failures |",
        "| --- | ---: | ---: |",
        *(f"| {kind} | {kinds[kind]} | {failed_kinds[kind]} |" for kind, _ in MIX),
        "",
        "| window | requests | failures | ITL p95 (ms) | RSS median / peak (MB) "
        "| MLX buffer cache (MB) | engine step (ms) | decode tok/s | rows running "
        "| machine probe (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {w['window']} | {w['requests']} | {w['failures']} | {w['itl_p95_ms']} | "
            f"{w['rss_mb']:.0f} / {w['rss_max_mb']:.0f} | {w['mlx_cache_mb']} | "
            f"{w.get('step_ms', '-')} | {w.get('decode_tok_s', '-')} | {w.get('running', '-')} | "
            f"{w.get('probe_ms', '-')} |"
            for w in per_window
        ),
        "",
    ]
    if failures:
        lines += ["Failures:", "", *(f"- {count} x {why}" for why, count in failures.items()), ""]
    lines += [
        "Memory over time (MB) and the streams the engine holds:",
        "",
        "| at (s) | RSS | MLX live arrays | MLX buffer cache | prefix cache | open |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {s.at_s:.0f} | {s.rss_mb} | {s.mlx_active_mb} | {s.mlx_cache_mb} "
        f"| {s.prefix_cache_mb} | {s.open_streams} |"
        for s in soak.samples[:: max(1, len(soak.samples) // 30)]
    ]
    path = publish(lines, args.out, "soak")
    raw = {
        "windows": per_window,
        "samples": [asdict(s) for s in soak.samples],
        "failures": dict(failures),
        "kinds": dict(kinds),
        "after": asdict(after),
    }
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--window-minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mlxgate-args", default="", help="extra server flags, one string")
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    args = parser.parse_args()
    port = free_port()
    extra = ["--resume-window", str(RESUME_WINDOW_S), *args.mlxgate_args.split()]
    command = mlxgate_command(port, extra)
    server = Server("mlxgate", command, port, ROOT / "benches" / ".cache" / "logs" / "soak.log")
    server.start()
    check_loopback(server.url)
    try:
        soak = Soak(server.url, command, args.minutes, args.clients, args.seed)
        asyncio.run(soak.run(server.pid))
        after = asyncio.run(drain_check(server.url, server.pid, soak.started))
        report(soak, args.window_minutes * 60, after, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
