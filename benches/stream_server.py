"""Server-level stream benchmark: N concurrent streaming clients on /v1/messages, mlxgate's Rust
router vs the pure-Python path, same app, same fake engine, same run.

    .venv/bin/python benches/stream_server.py            # 1,000 streams x 256 tokens, both routers
    .venv/bin/python benches/stream_server.py --quick    # 200 streams x 200 tokens (smoke test)

Each router gets a fresh server (benches/fake_engine_app.py under granian). The engine waits
until all N streams are open, then steps them all as fast as it can, so what limits the rate is
the stream path: router, event loop, granian. The clients are raw asyncio HTTP/1.1 connections
that only count `content_block_delta` events and note when they arrive, so that on a 2-core
machine the clients stay far cheaper per event than the server they measure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson
from stream_workload import STOP_SEQUENCES

from mlxgate.bench.machine import CpuSampler
from mlxgate.bench.spawn import Server, free_port

BENCHES = Path(__file__).resolve().parent
RESULTS = BENCHES / "results"
LOGS = BENCHES / ".cache" / "logs"
ROUTERS = ("rust", "python")
LABELS = {"rust": "mlxgate (Rust Router)", "python": "pure Python (mlx-lm detokenizer, orjson)"}
# Lines the fake engine prints (time.monotonic(), the same clock in every process on Linux).
STEPPING_FROM = "fake engine: stepping from"
IDLE_FROM = "fake engine: idle from"  # followed by the step count
DELTA = b"event: content_block_delta"
STOP = b"event: message_stop"


@dataclass
class StreamRecord:
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, deltas)
    finished: bool = False
    error: str | None = None


class StreamClient(asyncio.Protocol):
    """One streamed request on its own connection; notes when content deltas arrive."""

    def __init__(self, request: bytes, record: StreamRecord, done: asyncio.Future[None]) -> None:
        self.request = request
        self.record = record
        self.done = done
        self.tail = b""  # a marker may be split across reads
        self.status_checked = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.status_checked:
            self.status_checked = True
            if not data.startswith(b"HTTP/1.1 200"):
                self.record.error = data[:300].decode(errors="replace")
                self._close()
                return
        text = self.tail + data
        if deltas := text.count(DELTA):
            self.record.arrivals.append((now, deltas))
        if STOP in text:
            self.record.finished = True
            self._close()
        self.tail = text[-(len(DELTA) - 1) :]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.record.finished and self.record.error is None:
            self.record.error = f"connection closed early: {exc}"
        if not self.done.done():
            self.done.set_result(None)

    def _close(self) -> None:
        assert self.transport is not None
        self.transport.close()


def request_bytes(port: int, model: str, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stop_sequences": STOP_SEQUENCES,
            "messages": [{"role": "user", "content": "Tell me the lighthouse keeper's story."}],
        }
    )
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\nanthropic-version: 2023-06-01\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


async def run_clients(
    port: int, model: str, streams: int, max_tokens: int, timeout_s: float
) -> list[StreamRecord]:
    loop = asyncio.get_running_loop()
    request = request_bytes(port, model, max_tokens)
    records = [StreamRecord() for _ in range(streams)]
    done = [loop.create_future() for _ in range(streams)]

    async def one(record: StreamRecord, finished: asyncio.Future[None]) -> None:
        try:
            await loop.create_connection(
                lambda: StreamClient(request, record, finished), "127.0.0.1", port
            )
            await finished
        except OSError as exc:
            record.error = f"connect: {exc}"

    await asyncio.wait_for(asyncio.gather(*map(one, records, done)), timeout_s)
    return records


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


@dataclass
class EngineTimes:
    """From the server's log: when the engine started stepping, went idle, and its step count."""

    stepping_from: float
    idle_from: float
    steps: int

    @classmethod
    def from_log(cls, log: str) -> EngineTimes:
        stepping = [line for line in log.splitlines() if line.startswith(STEPPING_FROM)]
        idle = [line for line in log.splitlines() if line.startswith(IDLE_FROM)]
        if not stepping or not idle:
            raise RuntimeError(f"the fake engine did not report its start and end:\n{log}")
        at, steps = idle[-1].removeprefix(IDLE_FROM).split()
        return cls(float(stepping[-1].split()[-1]), float(at), int(steps))


@dataclass
class RouterRun:
    router: str
    streams: int
    events: int
    seconds: float  # engine start to the last delta received
    events_per_s: float
    engine_s: float  # engine start to its last step
    engine_steps: int
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    read_gap_p50_ms: float
    read_gap_p99_ms: float
    server_cores: float | None
    cpu_us_per_event: float | None
    failures: int
    first_error: str | None


def summarize(
    router: str, records: list[StreamRecord], engine: EngineTimes, cpu: CpuSampler
) -> RouterRun:
    arrivals = [r.arrivals for r in records if r.arrivals]
    if not arrivals:
        raise RuntimeError(f"{router}: no stream got a delta; first error: {records[0].error}")
    events = sum(n for stream in arrivals for _, n in stream)
    # Every stream is open when the engine starts: from then until the last delta arrived.
    start, end = engine.stepping_from, max(stream[-1][0] for stream in arrivals)
    gaps: list[float] = []  # between consecutive deltas of a stream
    read_gaps: list[float] = []  # between consecutive reads that brought deltas
    for stream in arrivals:
        for (before, _), (at, n) in itertools.pairwise(stream):
            read_gaps.append(at - before)
            gaps.append(at - before)
            gaps.extend([0.0] * (n - 1))  # deltas that arrived in the same read
        gaps.extend([0.0] * (stream[0][1] - 1))
    cores = cpu.usage(start, end)
    return RouterRun(
        router=router,
        streams=len(records),
        events=events,
        seconds=end - start,
        events_per_s=events / (end - start),
        engine_s=engine.idle_from - start,
        engine_steps=engine.steps,
        gap_p50_ms=percentile(gaps, 0.5) * 1e3,
        gap_p99_ms=percentile(gaps, 0.99) * 1e3,
        gap_max_ms=max(gaps) * 1e3,
        read_gap_p50_ms=percentile(read_gaps, 0.5) * 1e3,
        read_gap_p99_ms=percentile(read_gaps, 0.99) * 1e3,
        server_cores=cores,
        cpu_us_per_event=None if cores is None else cores * (end - start) / events * 1e6,
        failures=sum(1 for r in records if r.error is not None or not r.finished),
        first_error=next((r.error for r in records if r.error), None),
    )


def run_router(router: str, streams: int, max_tokens: int, timeout_s: float) -> RouterRun:
    port = free_port()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    command = [sys.executable, str(BENCHES / "fake_engine_app.py"), "--router", router]
    command += ["--port", str(port), "--gate", str(streams)]
    server = Server(f"stream-{router}", command, port, LOGS / f"{stamp}-stream-{router}.log")
    server.start(ready_timeout_s=120.0)
    try:
        model = httpx.get(f"{server.url}/health", timeout=5.0).json()["model"]
        with CpuSampler(server.pid, interval_s=0.02) as cpu:
            records = asyncio.run(run_clients(port, model, streams, max_tokens, timeout_s))
    finally:
        server.stop()
    return summarize(router, records, EngineTimes.from_log(server.log_path.read_text()), cpu)


def _optional(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[RouterRun], streams: int, max_tokens: int) -> str:
    lines = [
        f"### {streams} concurrent streams x {max_tokens} tokens on /v1/messages, fake engine",
        "",
        "| router | events | events/s | engine done (s) | all delivered (s) "
        "| inter-event p50 / p99 / max (ms) | between reads p50 / p99 (ms) | server cores "
        "| CPU µs / event | failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        lines.append(
            f"| {LABELS[run.router]} | {run.events:,} | {run.events_per_s:,.0f} "
            f"| {run.engine_s:.2f} | {run.seconds:.2f} "
            f"| {run.gap_p50_ms:.1f} / {run.gap_p99_ms:.1f} / {run.gap_max_ms:.1f} "
            f"| {run.read_gap_p50_ms:.1f} / {run.read_gap_p99_ms:.1f} "
            f"| {_optional(run.server_cores, '.2f')} | {_optional(run.cpu_us_per_event, '.1f')} "
            f"| {run.failures} |"
        )
    by_router = {run.router: run for run in runs}
    if set(ROUTERS) <= set(by_router):
        ratio = by_router["rust"].events_per_s / by_router["python"].events_per_s
        lines += ["", f"Rust / pure Python: **{ratio:.2f}x events/s** (target >= 2x)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--quick", action="store_true", help="200 streams x 200 tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per router")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.tokens = 200, 200
    routers = args.routers.split(",")
    load_before = os.getloadavg()
    runs = [run_router(router, args.streams, args.tokens, args.timeout) for router in routers]
    load_after = os.getloadavg()
    command = " ".join([".venv/bin/python benches/stream_server.py", *sys.argv[1:]])
    report = "\n".join(
        [
            table(runs, args.streams, args.tokens),
            "",
            f"Command: `{command}`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
            f"load average {load_before[0]:.2f} at start, {load_after[0]:.2f} at end.",
        ]
    )
    print(report)
    for run in runs:
        if run.first_error:
            print(f"{run.router}: first error: {run.first_error}", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"stream-server-{time.strftime('%Y%m%d-%H%M%S')}"
    out.with_suffix(".md").write_text(report + "\n")
    out.with_suffix(".json").write_text(json.dumps([asdict(run) for run in runs], indent=2))
    print(f"\nwritten to {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
