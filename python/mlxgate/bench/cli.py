"""`mlxgate bench`: measure one or more running servers, write a run directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlxgate.bench.figures import Slo
from mlxgate.bench.run import Sweep, Target, run_bench


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(part) for part in text.split(","))
    if not levels or min(levels) < 1:
        raise ValueError("concurrency levels are positive integers")
    return levels


def parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(
        prog="mlxgate bench",
        description="Measure servers that speak the Anthropic, OpenAI or Responses API (on this "
        "machine: loopback only), interleaved, into a run directory: records.jsonl (one line "
        "per request), summary.json and report.md.",
    )
    bench.add_argument(
        "--target",
        action="append",
        type=Target.parse,
        required=True,
        metavar="NAME=URL[,dialect=D][,pid=PID][,model=M]",
        help="a server to measure (repeatable); dialect anthropic, openai (default) or "
        "responses; with pid, its CPU time per output token is reported",
    )
    bench.add_argument(
        "--concurrency", type=_levels, default=Sweep.levels, metavar="C,C,...",
        help="the sweep's levels (default: 1,2,4,8)",
    )  # fmt: skip
    bench.add_argument(
        "--requests-per-client", type=int, default=Sweep.requests_per_client, metavar="N",
        help="requests per client at each level (default: 4)",
    )  # fmt: skip
    bench.add_argument(
        "--rate", type=float, default=None, metavar="R",
        help="requests a second, Poisson arrivals (default: a closed loop)",
    )  # fmt: skip
    bench.add_argument(
        "--max-tokens", type=int, default=Sweep.max_tokens, metavar="N",
        help="output tokens each request asks for (default: 128)",
    )  # fmt: skip
    bench.add_argument(
        "--slo", type=Slo.parse, default=Slo(), metavar="ttft=2s,itl=250ms",
        help="the objective goodput counts replies against (default: ttft=2s,itl=250ms)",
    )  # fmt: skip
    bench.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="the run directory (default: bench-<time> here)",
    )  # fmt: skip
    return bench


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    sweep = Sweep(args.concurrency, args.requests_per_client, args.max_tokens, args.rate)
    out = args.out or Path(f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    run_bench(args.target, sweep, args.slo, out)
    print((out / "report.md").read_text())
    print(f"wrote {out}/")
