"""Where an engine's steps spend their time under a load: each step's plan, its decode (or
verify) pass, its prefill passes, the starts and the joins.

    PYTHONPATH=benches .venv/bin/python benches/studies/step_trace.py burst \
        [--prompts 32] [--spread-ms 300] [--max-tokens 64] [--rounds 2]
    PYTHONPATH=benches .venv/bin/python benches/studies/step_trace.py hol \
        [--streams 4] [--long-tokens 12000] [--max-tokens 1500]

In-process, the embedded model, the server's defaults (`burst` turns speculation off: its
prompts are too short to guess from).
- `burst`: a shared system prompt is asked once (so the prefix cache holds it, as in the bench's
  sweep), then `--prompts` prompts that share it, of eight question lengths, arrive spread over
  `--spread-ms`. Reports the time-to-first-token percentiles and every step that prefilled.
- `hol`: `--streams` stories decode, then a prompt of about `--long-tokens` lands: reports the
  steps while it prefills, the longest first, against the median step of the streams alone.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import publish

SYSTEM = "You are a helpful assistant. Answer in one or two sentences, plainly and precisely. "
KINDS = ("decode", "pass", "start", "join")


class Tracer:
    """An engine whose steps are timed, part by part."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
        from mlxgate._native import Router
        from mlxgate.engine import Engine, EngineSettings
        from mlxgate.models import load

        loaded = load(None)
        self.tok = loaded.tokenizer
        self.engine = engine = Engine(
            loaded, Router(self.tok.native_vocab()), EngineSettings(**settings)
        )
        self.events: list[tuple[str, float, int]] = []
        self.steps: list[dict[str, Any]] = []
        self.firsts: list[float] = []  # seconds from admission to joining the batch
        prefill = engine.prefill
        prefill._forward = self._timed("pass", prefill._forward)  # type: ignore[method-assign]
        prefill._start = self._timed("start", prefill._start)  # type: ignore[method-assign]
        prefill._join = self._timed("join", self._first_tokens(prefill._join))
        engine.decoder.step = self._timed("decode", engine.decoder.step)  # type: ignore[method-assign]
        self.steered: list[str] = []
        steered_chunk = engine.scheduler.steered_chunk

        def logged(last: tuple[int, float], todo: int, left_s: float, fixed_s: float = 0) -> int:
            chunk = steered_chunk(last, todo, left_s, fixed_s)
            self.steered.append(
                f"{last[0]} in {1000 * last[1]:.0f} ms, {1000 * left_s:.0f} ms left: {chunk}"
            )
            return chunk

        engine.scheduler.steered_chunk = logged  # type: ignore[method-assign, assignment]
        self._step = engine._step
        engine._step = self._traced_step  # type: ignore[method-assign]
        engine.start()

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                size = 0
                if name == "pass" and hasattr(args[0], "shape"):
                    size = int(args[0].size)
                elif name == "join":
                    size = len(args[0])
                self.events.append((name, time.perf_counter() - started, size))

        return wrapper

    def _first_tokens(self, join: Callable[..., None]) -> Callable[..., None]:
        def joined(joining: list[Any], caches: list[Any]) -> None:
            join(joining, caches)
            now = time.monotonic()
            self.firsts.extend(now - p.submitted_at for p in joining)

        return joined

    def _traced_step(self, plan: Any) -> None:
        self.events.clear()
        self.steered.clear()
        decoder, prefill = self.engine.decoder, self.engine.prefill
        rows, waiting = len(decoder), len(prefill.waiting)
        started = time.perf_counter()
        self._step(plan)
        total = time.perf_counter() - started
        p = plan.prefill
        self.steps.append(
            {
                "at": time.perf_counter(),
                "rows": rows,
                "waiting": waiting,
                "guesses": int(plan.drafts.counts.sum()) if plan.drafts is not None else 0,
                "budget": p.budget if p else 0,
                "allowance_ms": round(1000 * p.allowance_s) if p and p.allowance_s else None,
                "total": total,
                **{k: sum(s for name, s, _ in self.events if name == k) for k in KINDS},
                "passes": [n for name, _, n in self.events if name == "pass"],
                "joined": sum(n for name, _, n in self.events if name == "join"),
                "steered": "; ".join(self.steered),
            }
        )

    def ids(self, question: str, system: str | None = SYSTEM) -> list[int]:
        messages = [{"role": "user", "content": question}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.tok.encode(self.tok.render(messages))

    def submit(self, prompt: list[int], max_tokens: int) -> Any:
        from mlxgate._native import Reply, StreamSpec
        from mlxgate.engine import GenerationRequest

        spec = StreamSpec.anthropic(
            model="m", message_id="msg", stream=True, stop_sequences=[],
            reply=Reply(eos_ids=sorted(self.tok.eos_ids)),
        )  # fmt: skip
        return self.engine.admit(GenerationRequest(prompt, spec, max_tokens))


def drain(reader: Any, first: threading.Event | None = None) -> None:
    """Read a stream to its end; `first` is set at its first content (past message_start)."""
    ready = threading.Event()
    while (data := reader.take()) is not None:
        if first is not None and b"content_block_delta" in data:
            first.set()
        ready.clear()
        if reader.park(ready, lambda _: ready.set()):
            ready.wait(1.0)


def row(s: dict[str, Any]) -> str:
    return (
        f"| {s['rows']} | {s['waiting']} | {s['guesses']} | {s['budget']} "
        f"| {s['allowance_ms']} | {1000 * s['decode']:.0f} "
        f"| {1000 * s['pass']:.0f} ({', '.join(map(str, s['passes']))}) "
        f"| {1000 * s['start']:.0f} | {1000 * s['join']:.0f} ({s['joined']}) "
        f"| {1000 * s['total']:.0f} | {s['steered']} |"
    )


HEADER = [
    "| rows | waiting | guesses | budget | allowance ms | decode ms | passes ms (tokens) "
    "| starts ms | joins ms (rows) | step ms | chunk steered from |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | --- |",
]


def burst(args: argparse.Namespace) -> list[str]:
    tracer = Tracer({"max_draft_tokens": 0})
    drain(tracer.submit(tracer.ids("Say hello."), 8))  # the system prompt in the prefix cache
    lines = []
    for round_ in range(args.rounds):
        tracer.steps.clear()
        tracer.firsts.clear()
        readers = []
        for index in range(args.prompts):
            words = " ".join(["more"] * (index % 8) * 4)
            question = f"Question {round_}-{index}: what is {index} plus {words} one?"
            readers.append(tracer.submit(tracer.ids(question), args.max_tokens))
            time.sleep(args.spread_ms / 1000 / args.prompts)
        for reader in readers:
            drain(reader)
        firsts = sorted(tracer.firsts)
        p50, p95 = firsts[len(firsts) // 2], firsts[int(0.95 * (len(firsts) - 1))]
        prefilling = [s for s in tracer.steps if s["passes"]]
        alone = [s["total"] for s in tracer.steps if not s["passes"]] or [0.0]
        lines += [
            f"## Round {round_ + 1}: TTFT p50 {p50:.2f} s, p95 {p95:.2f} s, "
            f"last {firsts[-1]:.2f} s",
            "",
            f"{len(prefilling)} steps prefilled; their seconds: "
            + ", ".join(f"{k} {sum(s[k] for s in prefilling):.2f}" for k in KINDS)
            + f"; median decode-only step {1000 * statistics.median(alone):.0f} ms",
            "",
            *HEADER,
            *(row(s) for s in prefilling),
            "",
        ]
    tracer.engine.stop()
    return lines


def hol(args: argparse.Namespace) -> list[str]:
    from mlxgate.bench.load import story_prompt
    from mlxgate.bench.scenarios import long_prompt

    tracer = Tracer({})
    streams = []
    for index in range(args.streams):
        prompt = tracer.ids(story_prompt(index).user, system=None)
        reader = tracer.submit(prompt, args.max_tokens)
        streams.append(threading.Thread(target=drain, args=(reader,)))
        streams[-1].start()
    time.sleep(2.0)
    tracer.steps.clear()
    long = tracer.ids(long_prompt(args.long_tokens, "trace").user, system=None)
    sent = time.perf_counter()
    first = threading.Event()
    reader = tracer.submit(long, 4)
    waiting = threading.Thread(target=drain, args=(reader, first))
    waiting.start()
    first.wait()
    prefill_s = time.perf_counter() - sent
    window = [s for s in tracer.steps if s["at"] <= sent + prefill_s]
    for stream in streams:
        stream.join()
    waiting.join()
    after = [s["total"] for s in tracer.steps if s["at"] > sent + prefill_s and s["rows"]]
    tracer.engine.stop()
    median = statistics.median(after) if after else float("nan")
    worst = sorted(window, key=lambda s: -s["total"])[:12]
    joins = [s for s in window if s["joined"]]
    return [
        f"{len(long)} prompt tokens prefilled in {prefill_s:.1f} s beside {args.streams} streams "
        f"over {len(window)} steps; the longest {1000 * worst[0]['total']:.0f} ms, "
        f"{worst[0]['total'] / median:.2f}x the median step after it ({1000 * median:.0f} ms)",
        "",
        "The longest steps during the prefill, in order of length:",
        "",
        *HEADER,
        *(row(s) for s in worst),
        "",
        "The step it joined in:",
        "",
        *HEADER,
        *(row(s) for s in joins),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("burst", "hol"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--spread-ms", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=12000)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 64 if args.scenario == "burst" else 1500
    command = " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("out", "scenario")
    )
    lines = [
        f"# The engine's steps traced: {args.scenario}",
        "",
        f"Command: `PYTHONPATH=benches .venv/bin/python benches/studies/step_trace.py "
        f"{args.scenario} {command}`",
        "",
        *(burst(args) if args.scenario == "burst" else hol(args)),
    ]
    publish(lines, args.out, f"step-trace-{args.scenario}")


if __name__ == "__main__":
    main()
