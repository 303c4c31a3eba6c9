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
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxgate.bench.figures import percentile
from mlxgate.bench.load import Load, Prompt, run, story_prompt
from mlxgate.bench.records import Record

DIALECTS = ("anthropic", "openai")


@dataclass
class LoadRun:
    results: list[Record]
    wall_s: float


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
    load = Load(
        base_url,
        dialect,
        requests,
        concurrency,
        max_tokens,
        model,
        prompt=lambda i: prompts[i % len(prompts)],
        timeout_s=timeout_s,
        stall_s=stall_s,
    )
    started = time.monotonic()
    records = await run(load)
    return LoadRun(records, time.monotonic() - started)


# Goodput's service-level objective: a reply starts within TTFT_SLO_S and then takes at most
# TPOT_SLO_S per token on average.
TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.25


def _decode_s(r: Record) -> float | None:
    """Seconds from a reply's first token to its last."""
    return None if r.ttft_s is None else r.ended_at - r.sent_at - r.ttft_s


def _meets_slo(r: Record) -> bool:
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
