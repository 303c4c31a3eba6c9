"""31 streams with and without a 32nd client that never reads its stream: do the 31 notice?

    .venv/bin/python benches/studies/stalled_reader.py [--streams 31] [--tokens 128]

One mlxgate server on the embedded model (prefix cache off). Run A: the streams alone. Run B:
the same streams while one more client sends a streaming request with a 4 KiB receive buffer
and never reads a byte of the answer. Reported: inter-token latency of the streams (p50/p95)
in both runs, their ratio, failures, and the server's resident memory after each run. The
engine never waits for a reader: the stalled stream's frames coalesce in its channel (bounded
by `max_unread_bytes`) and past the stall timeout it is cancelled with an error event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

from mlxgate.bench.figures import percentile
from mlxgate.bench.load import Load, request_body, run, story_prompt
from mlxgate.bench.machine import rss_mb
from mlxgate.bench.spawn import Server, free_port, mlxgate_command

BENCHES = Path(__file__).resolve().parents[1]


def stalled_client(url: str, max_tokens: int) -> socket.socket:
    """Send one streaming request and never read: the server's writes back up."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(request_body("anthropic", story_prompt(7), max_tokens, "default")).encode()
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"anthropic-version: 2023-06-01\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


async def measure(url: str, streams: int, tokens: int) -> dict[str, float]:
    began = time.monotonic()
    records = await run(Load(url, "anthropic", streams, streams, tokens, "default"))
    wall_s = time.monotonic() - began
    gaps = [gap for r in records if r.ok for gap in r.gaps]
    return {
        "failed": sum(not r.ok for r in records),
        "itl_p50_s": statistics.median(gaps),
        "itl_p95_s": percentile(gaps, 95) or 0.0,
        "output_tok_s": sum(r.output_tokens or 0 for r in records) / wall_s,
    }


async def main_async(args: argparse.Namespace) -> None:
    port = free_port()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    server = Server(
        "mlxgate",
        # No prefix cache: the second run would reuse the first one's prompts.
        mlxgate_command(port, ["--prefix-cache-mb", "0"]),
        port,
        BENCHES / f".cache/logs/{stamp}-stalled-reader.log",
    )
    server.start()
    try:
        await measure(server.url, args.streams, 8)  # warm-up: every batch size once
        alone = await measure(server.url, args.streams, args.tokens)
        alone["rss_mb"] = rss_mb(server.pid)
        sock = stalled_client(server.url, 4000)
        await asyncio.sleep(1.0)
        beside = await measure(server.url, args.streams, args.tokens)
        beside["rss_mb"] = rss_mb(server.pid)
        sock.close()
    finally:
        server.stop()
    ratio = beside["itl_p95_s"] / alone["itl_p95_s"]
    lines = [
        f"# Stalled reader, {time.strftime('%Y-%m-%d %H:%M')}",
        f"Command: `python benches/studies/stalled_reader.py --streams {args.streams} "
        f"--tokens {args.tokens}`",
        "",
        "| run | failed | ITL p50 ms | ITL p95 ms | output tok/s | server RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in ((f"{args.streams} streams", alone), ("+ 1 never-reading client", beside)):
        lines.append(
            f"| {name} | {row['failed']:.0f} | {row['itl_p50_s'] * 1000:.0f} | "
            f"{row['itl_p95_s'] * 1000:.0f} | {row['output_tok_s']:.1f} | {row['rss_mb']:.0f} |"
        )
    lines += ["", f"ITL p95 with / without the stalled reader: {ratio:.2f}x (target <= 1.2x)."]
    text = "\n".join(lines) + "\n"
    out = BENCHES / "results" / f"stalled-reader-{stamp}.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=31)
    parser.add_argument("--tokens", type=int, default=128)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
