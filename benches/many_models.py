"""Two models in one server: the first token of a request to a model not loaded (its load and
prefill) against one loaded; and each model's throughput when both take load against one alone.

    .venv/bin/python benches/many_models.py [--second SOURCE]

Starts `mlxgate serve --model embedded --model second=SOURCE` (SOURCE: the embedded model again
by default, or any --model value, e.g. a GGUF file). First-token times: the second model is
unloaded (`POST /v1/models/second/unload`), then asked (it loads), then asked again (loaded),
`--repeats` times. Throughput: C clients in a closed loop on the embedded model alone, then C on
each model at once, then the first again (the machine's speed drifts: two runs of the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from report import publish

from mlxgate.bench.load import Load, run
from mlxgate.bench.spawn import Server, free_port, mlxgate_command, stop_all
from mlxgate.models import DEFAULT_MODEL

BENCHES = Path(__file__).resolve().parent


async def closed_loop(
    url: str, models: list[str], clients: int, requests: int, tokens: int
) -> tuple[dict[str, float], float]:
    """`clients` clients per model at once; each model's output tokens a second until its last
    request ended, and the wall time of the whole."""
    loads = [Load(url, "openai", requests, clients, tokens, model=model) for model in models]
    started = time.monotonic()
    results = await asyncio.gather(*(run(load) for load in loads))
    wall = time.monotonic() - started
    rates = {}
    for model, records in zip(models, results, strict=True):
        failed = [r.error for r in records if r.error]
        if failed:
            raise RuntimeError(f"requests failed: {failed[:3]}")
        ended = max(r.ended_at for r in records) - started
        rates[model] = sum(r.output_tokens or 0 for r in records) / ended
    return rates, wall


def first_token(url: str, model: str) -> float:
    load = Load(url, "openai", 1, 1, 8, model=model)
    (record,) = asyncio.run(run(load))
    if record.error or record.ttft_s is None:
        raise RuntimeError(f"the request failed: {record.error}")
    return record.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--second", default="embedded", help="the second model's --model value")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="per model and run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=BENCHES / "results")
    args = parser.parse_args()

    try:
        with tempfile.TemporaryDirectory() as work:
            port = free_port()
            flags = ["--model", "embedded", "--model", f"second={args.second}"]
            server = Server("mlxgate", mlxgate_command(port, flags), port, Path(work) / "log")
            server.start()
            url = server.url
            cold, warm = [], []
            for _ in range(args.repeats):
                httpx.post(f"{url}/v1/models/second/unload", timeout=60).raise_for_status()
                cold.append(first_token(url, "second"))
                warm.append(first_token(url, "second"))
            print(f"first token: unloaded {cold}, loaded {warm}")
            runs = []
            for name, models in (
                ("embedded alone", [DEFAULT_MODEL]),
                ("second alone", ["second"]),
                ("both at once", [DEFAULT_MODEL, "second"]),
                ("embedded alone, again", [DEFAULT_MODEL]),
            ):
                rates, wall = asyncio.run(
                    closed_loop(url, models, args.clients, args.requests, args.max_tokens)
                )
                runs.append((name, rates, wall))
                print(name, {m: round(r, 1) for m, r in rates.items()}, f"{wall:.1f} s")
            server.stop()
    finally:
        stop_all()
    alone = {
        model: statistics.mean(r[model] for _, r, _ in runs if len(r) == 1 and model in r)
        for model in (DEFAULT_MODEL, "second")
    }
    lines = [
        f"# Two models in one server ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/many_models.py --second {args.second}`: `mlxgate serve --model embedded "
        f"--model second={args.second}`, OpenAI streamed requests.",
        "",
        "## First token of a request to the second model",
        "",
        "| the second model | first token (median) | each |",
        "| --- | ---: | --- |",
        f"| not loaded (load + prefill) | {statistics.median(cold):.2f} s | "
        + ", ".join(f"{t:.2f}" for t in cold)
        + " |",
        f"| loaded | {statistics.median(warm):.3f} s | "
        + ", ".join(f"{t:.3f}" for t in warm)
        + " |",
        "",
        f"## Throughput: {args.clients} clients per model, {args.requests} requests each, "
        f"{args.max_tokens} tokens",
        "",
        "Each model's rate: its output tokens over the time until its own last request ended; "
        "x alone: against its runs alone (mean).",
        "",
        "| run | embedded tok/s | x alone | second tok/s | x alone | wall |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rates, wall in runs:
        cells = [
            f"{rates[m]:.1f} | {rates[m] / alone[m]:.2f}" if m in rates else "- | -"
            for m in (DEFAULT_MODEL, "second")
        ]
        lines.append(f"| {name} | {' | '.join(cells)} | {wall:.1f} s |")
    publish(lines, args.out, "many-models")


if __name__ == "__main__":
    main()
