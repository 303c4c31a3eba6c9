"""An agent's first turn after a restart: cold, and with the prefix cache's disk tier warm.

    .venv/bin/python benches/warm_restart.py [--trace benches/traces/claude-code.jsonl]

Starts mlxgate with an empty `--prefix-cache-dir`, sends the trace's first turn (Claude Code's
~12.8k-token first request) and times its first token: cold. Stops the server (SIGTERM), starts
it again on the same directory and sends the same turn: warm. Then once more on an emptied
directory: cold again, so that a machine whose speed drifted shows as two cold times apart.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from report import publish

from mlxgate.bench.records import Record
from mlxgate.bench.replay import replay
from mlxgate.bench.spawn import Server, free_port, mlxgate_command, stop_all
from mlxgate.trace import read, sessions

BENCHES = Path(__file__).resolve().parent


def first_turn(url: str, trace: Path, max_tokens: int) -> Record:
    first = sessions(read(trace))[0][:1]
    records = asyncio.run(replay(url, [first], 1, max_tokens=max_tokens))
    (record,) = records
    if record.error:
        raise RuntimeError(f"the turn failed: {record.error}")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=BENCHES / "traces" / "claude-code.jsonl")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=BENCHES / "results")
    args = parser.parse_args()

    runs: list[tuple[str, Record, float]] = []
    try:
        with tempfile.TemporaryDirectory() as work:
            cache, logs = Path(work) / "cache", Path(work) / "logs"
            for name, empty in (("cold", True), ("warm", False), ("cold again", True)):
                if empty:
                    shutil.rmtree(cache, ignore_errors=True)
                port = free_port()
                command = mlxgate_command(port, ["--prefix-cache-dir", str(cache)])
                server = Server("mlxgate", command, port, logs / f"{name}.log")
                started = time.perf_counter()
                server.start()
                ready_s = time.perf_counter() - started
                record = first_turn(server.url, args.trace, args.max_tokens)
                server.stop(grace_s=60.0)  # SIGTERM: the writer finishes what it queued
                runs.append((name, record, ready_s))
                print(f"{name}: first token {record.ttft_s:.2f} s, {record.cached_tokens} cached")
    finally:
        stop_all()
    cold = statistics.mean(r.ttft_s or 0.0 for name, r, _ in runs if name.startswith("cold"))
    lines = [
        f"# An agent's first turn after a restart ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/warm_restart.py --trace {args.trace.name}`: mlxgate with `--prefix-cache-dir`,"
        " the trace's first turn, one server at a time; warm: after a SIGTERM and a start on the"
        " directory the cold run filled.",
        "",
        "| run | start-up | prompt tokens | cached | first token | x cold (mean) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, record, ready_s in runs:
        ttft = record.ttft_s or 0.0
        lines.append(
            f"| {name} | {ready_s:.1f} s | {record.input_tokens} | {record.cached_tokens} "
            f"| {ttft:.2f} s | {ttft / cold:.3f}x |"
        )
    publish(lines, args.out, "warm-restart")


if __name__ == "__main__":
    main()
