"""`mlxgate bench`: measure one or more running servers, write a run directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlxgate.bench.figures import Slo
from mlxgate.bench.run import Replay, Sweep, Target, run_bench
from mlxgate.bench.scenarios import SCENARIOS, Sizes
from mlxgate.bench.spawn import SERVERS, spawn, stop_all


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(part) for part in text.split(","))
    if not levels or min(levels) < 1:
        raise ValueError("concurrency levels are positive integers")
    return levels


SCENARIO_NAMES = ("sweep", *SCENARIOS, "agent")


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    if not set(names) <= set(SCENARIO_NAMES):
        raise ValueError(f"scenarios are {', '.join(SCENARIO_NAMES)}")
    return names


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
        default=[],
        metavar="NAME=URL[,dialect=D][,pid=PID][,model=M][,trace=chat]",
        help="a server to measure (repeatable); dialect anthropic, openai (default) or "
        "responses; with pid, its CPU time per output token is reported; with trace=chat, "
        "an agent trace is replayed to it as chat completions (a server with no other API)",
    )
    bench.add_argument(
        "--spawn", action="append", choices=SERVERS, default=[], metavar="SERVER",
        help="start a known server on the embedded model (or --gguf) for the run (repeatable): "
        f"{', '.join(SERVERS)} (llama-server from the PATH or $LLAMA_SERVER)",
    )  # fmt: skip
    bench.add_argument(
        "--gguf", type=Path, default=None, metavar="FILE",
        help="the GGUF file the spawned servers serve instead of the embedded model "
        "(mlxgate and llama-server)",
    )  # fmt: skip
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
        help="output tokens each request asks for; an agent replay's at most (default: 128)",
    )  # fmt: skip
    bench.add_argument(
        "--slo", type=Slo.parse, default=Slo(), metavar="ttft=2s,itl=250ms",
        help="the objective goodput counts replies against (default: ttft=2s,itl=250ms)",
    )  # fmt: skip
    bench.add_argument(
        "--scenarios", type=_scenarios, default=("sweep",), metavar="S,S,...",
        help="sweep: the concurrency sweep; long: long prompts at once; hol: running streams' "
        "gaps while a long prompt lands; prefix: a long system prompt asked twice; disconnect: "
        "the server's CPU after a client goes (needs pid=); edit: source files asked back "
        "with a rename, speculative decoding's case; agent: replay --trace (default: sweep)",
    )  # fmt: skip
    bench.add_argument(
        "--hol-prompt", type=int, default=None, metavar="TOKENS",
        help="the head-of-line scenario's long prompt, about this many tokens (default: 1500); "
        "its streams ask for enough tokens to outlast its prefill",
    )  # fmt: skip
    bench.add_argument(
        "--quick", action="store_true",
        help="small scenario sizes, for a smoke run",
    )  # fmt: skip
    bench.add_argument(
        "--trace", type=Path, action="append", default=[], metavar="FILE",
        help="an agent trace (`mlxgate serve --record-trace FILE`) for the agent scenario; "
        "repeat it for the sessions of several",
    )  # fmt: skip
    bench.add_argument(
        "--sessions", type=int, default=1, metavar="N",
        help="agent sessions replayed at once, session k the traces' recorded session k modulo "
        "their number (default: 1)",
    )  # fmt: skip
    bench.add_argument(
        "--staggered", action="store_true",
        help="each agent session starts when the one before has its first answer, so that its "
        "first turn prefills while the earlier sessions' next turns run",
    )  # fmt: skip
    bench.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="the run directory (default: bench-<time> here)",
    )  # fmt: skip
    return bench


def main(argv: list[str]) -> None:
    bench = parser()
    args = bench.parse_args(argv)
    sweep = None
    if "sweep" in args.scenarios:
        sweep = Sweep(args.concurrency, args.requests_per_client, args.max_tokens, args.rate)
    replay = None
    if "agent" in args.scenarios:
        if not args.trace:
            bench.error("the agent scenario replays a --trace FILE")
        replay = Replay(tuple(args.trace), args.sessions, args.max_tokens, args.staggered)
    if not args.target and not args.spawn:
        bench.error("name a --target to measure, or --spawn a server")
    if args.gguf is not None and not args.gguf.is_file():
        bench.error(f"--gguf {args.gguf}: no such file")
    if args.gguf is not None and "mlx_lm" in args.spawn:
        bench.error("--spawn mlx_lm serves the embedded model's export only, not a --gguf")
    out = args.out or Path(f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    extra = tuple(name for name in args.scenarios if name in SCENARIOS)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.hol_prompt is not None:
        sizes = sizes.with_hol_prompt(args.hol_prompt)
    slots = max([*args.concurrency, sizes.long_prompts, sizes.hol_streams + 1, args.sessions])
    try:
        spawned = [spawn(name, slots, out / "logs", args.gguf).target() for name in args.spawn]
        targets = [*args.target, *spawned]
        run_bench(targets, sweep, args.slo, out, replay=replay, scenarios=extra, sizes=sizes)
    finally:
        stop_all()
    print((out / "report.md").read_text())
    print(f"wrote {out}/")
