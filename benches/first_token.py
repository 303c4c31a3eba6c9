"""Time to first token of one long prompt, each server alone, in one run (interleaved rounds).

    LLAMA_SERVER=benches/.cache/bin/llama-server .venv/bin/python benches/first_token.py \
        [--tokens 4096] [--rounds 2] [--spawn mlxgate --spawn llama-server-long ...] [--gguf FILE]

Each round sends every server one prompt of about `--tokens` tokens (the bench's long-prompt
filler, new words each time, so nothing is a cache hit) asking for one token through OpenAI's
chat completions, and times the first content (the whole prefill). The servers serve the
embedded model, or with `--gguf` that file; `llama-server-long` is the llama-server whose one
slot holds a prompt past 8k tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from report import publish

from mlxgate.bench.scenarios import long_prompt
from mlxgate.bench.spawn import served_name, spawn, stop_all


def first_token_s(url: str, model: str, tokens: int, seed: str) -> tuple[float, int]:
    """Seconds to the response of a one-token completion of a long prompt, and its prompt's
    token count as the server counted it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": long_prompt(tokens, seed).user}],
        "max_tokens": 1,
        "temperature": 0,
    }
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, int(response.json()["usage"]["prompt_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spawn", action="append", default=[])
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file both serve")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    names = args.spawn or ["mlxgate", "mlxgate-float32", "llama-server-8k"]

    servers = {}
    times: dict[str, list[float]] = {name: [] for name in names}
    counted: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory() as logs:
            for name in names:
                servers[name] = spawn(name, 1, Path(logs), args.gguf)
            for round_ in range(args.rounds):
                for name, server in servers.items():
                    seconds, prompt = first_token_s(
                        server.url, served_name(name, args.gguf), args.tokens, f"r{round_}-{name}"
                    )
                    times[name].append(seconds)
                    counted[name] = prompt
                    print(f"round {round_ + 1}, {name}: {seconds:.2f} s ({prompt} tokens)")
    finally:
        stop_all()
    base = statistics.median(times[names[0]])
    lines = [
        f"# Time to first token of one long prompt ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/first_token.py --tokens {args.tokens} --rounds {args.rounds}"
        + (f" --gguf {args.gguf.name}`" if args.gguf else "`")
        + ": one prompt at a time, each server alone on the machine, rounds interleaved; median "
        "over the rounds.",
        "",
        f"| server | prompt tokens | first token | x {names[0]} |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in names:
        median = statistics.median(times[name])
        lines.append(f"| {name} | {counted[name]} | {median:.2f} s | {median / base:.2f}x |")
    publish(lines, args.out, "first-token")


if __name__ == "__main__":
    main()
