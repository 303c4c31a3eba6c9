"""A benchmark run: every target through the scenarios, interleaved level by level (A, B, then
B, A, so a drift in the machine's speed falls on both), into a run directory:

    records.jsonl   one line per request (its target, scenario, concurrency and `Record`)
    summary.json    the machine, the targets and each run's figures
    report.md       the figures as tables, with each target's ratio to the first
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mlxgate.bench import plots
from mlxgate.bench.figures import Slo, percentile, summarize
from mlxgate.bench.load import Load, Prompt, run, story_prompt
from mlxgate.bench.machine import cpu_described, cpu_seconds, load_average
from mlxgate.bench.records import Record
from mlxgate.bench.replay import replay as replay_trace
from mlxgate.bench.scenarios import SCENARIOS, SPECULATION_COUNTERS, Outcome, Sizes
from mlxgate.bench.target import Target
from mlxgate.trace import read as read_trace
from mlxgate.trace import sessions


@dataclass(frozen=True)
class Sweep:
    """The concurrency sweep: at each level C, C clients (or, with a rate, Poisson arrivals
    with at most C in flight) send `requests_per_client` x C requests each."""

    levels: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_client: int = 4
    max_tokens: int = 128
    rate: float | None = None


# The clients each scenario has at once.
CONCURRENCY: dict[str, Callable[[Sizes], int]] = {
    "long": lambda sizes: sizes.long_prompts,
    "hol": lambda sizes: sizes.hol_streams + 1,
    "prefix": lambda sizes: 1,
    "disconnect": lambda sizes: 1,
    "edit": lambda sizes: 1,
}


@dataclass(frozen=True)
class Replay:
    """The agent-trace scenario: `sessions` sessions at once, session k the recorded session k
    (modulo their number) of `traces`, each reply held to `max_tokens` where the recorded request
    allowed more; `staggered`: each starts when the one before has its first answer."""

    traces: tuple[Path, ...]
    sessions: int = 1
    max_tokens: int | None = None
    staggered: bool = False


def run_bench(
    targets: list[Target],
    sweep: Sweep | None,
    slo: Slo,
    out: Path,
    *,
    replay: Replay | None = None,
    scenarios: tuple[str, ...] = (),
    sizes: Sizes | None = None,
    prompt: Callable[[int], Prompt] = story_prompt,
) -> dict[str, Any]:
    """Measure every target (the sweep, then each of `scenarios`, then the replay), write the run
    directory `out`, return its summary."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = sizes or Sizes()
    summary: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_described(),
            "cpus": os.cpu_count(),
            "load_before": load_average(),
        },
        "targets": [asdict(t) for t in targets],
        "sweep": None if sweep is None else asdict(sweep),
        "replay": None
        if replay is None
        else {**asdict(replay), "traces": [str(path) for path in replay.traces]},
        "scenarios": list(scenarios),
        "sizes": asdict(sizes),
        "runs": [],
    }
    started = time.monotonic()
    measured_records: list[Record] = []
    with (out / "records.jsonl").open("w") as records:

        def measured(
            target: Target,
            scenario: str,
            concurrency: int,
            load: Coroutine[Any, Any, list[Record] | Outcome],
        ) -> None:
            cpu_before = cpu_seconds(target.pid) if target.pid is not None else None
            began = time.monotonic()
            outcome = asyncio.run(load)
            wall_s = time.monotonic() - began
            if not isinstance(outcome, Outcome):
                outcome = Outcome(outcome)
            done = outcome.records
            cpu_s = None
            if target.pid is not None and cpu_before is not None:
                cpu_s = cpu_seconds(target.pid) - cpu_before
            for record in done:
                record.target, record.scenario, record.concurrency = (
                    target.name,
                    scenario,
                    concurrency,
                )
                records.write(json.dumps(record.to_json(started)) + "\n")
            measured_records.extend(done)
            run_ = {"target": target.name, "scenario": scenario, "concurrency": concurrency}
            figures = summarize(done, wall_s, slo, cpu_s)
            if scenario == "agent":
                figures["turn_ttft_s_p50"] = by_turn(done, lambda r: r.ttft_s)
                figures["turn_prompt_tokens_p50"] = by_turn(done, lambda r: r.input_tokens)
            if outcome.figures:
                figures["scenario_figures"] = outcome.figures
            summary["runs"].append({**run_, **figures})

        for target in targets:
            asyncio.run(run(_load(target, sweep or Sweep(), 1, 1, prompt)))  # warm-up
        if sweep is not None:
            total = sum(level * sweep.requests_per_client for level in sweep.levels)
            with tqdm(total=total * len(targets), desc="sweep") as bar:
                for step, level in enumerate(sweep.levels):
                    for target in targets if step % 2 == 0 else reversed(targets):
                        requests = level * sweep.requests_per_client
                        load = _load(target, sweep, level, requests, prompt)
                        measured(target, "sweep", level, run(load, lambda _: bar.update()))
        nonce = uuid.uuid4().hex[:8]  # prompts no earlier run has left in a server's cache
        for step, name in enumerate(scenarios):
            with tqdm(total=len(targets), desc=name) as bar:
                for target in targets if step % 2 == 0 else reversed(targets):
                    scenario = SCENARIOS[name](target, sizes, nonce)
                    measured(target, name, CONCURRENCY[name](sizes), scenario)
                    bar.update()
        if replay is not None:
            recorded = sessions([turn for path in replay.traces for turn in read_trace(path)])
            turns = sum(len(recorded[k % len(recorded)]) for k in range(replay.sessions))
            with tqdm(total=turns * len(targets), desc="agent") as bar:
                for target in targets:
                    agents = replay_trace(
                        target.url, recorded, replay.sessions, model=target.model,
                        max_tokens=replay.max_tokens, chat=target.trace_as_chat,
                        staggered=replay.staggered, on_done=lambda _: bar.update(),
                    )  # fmt: skip
                    measured(target, "agent", replay.sessions, agents)
    summary["machine"]["load_after"] = load_average()
    summary["plots"] = plots.draw(summary, measured_records, out) if plots.available() else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(report(summary))
    return summary


def by_turn(records: list[Record], value: Callable[[Record], float | None]) -> list[float | None]:
    """The median `value` of each turn (0, 1, ...) over the sessions that reached it."""
    turns = max((r.index for r in records), default=-1) + 1
    return [
        percentile([v for r in records if r.index == turn and (v := value(r)) is not None], 50)
        for turn in range(turns)
    ]


def _load(
    target: Target, sweep: Sweep, level: int, requests: int, prompt: Callable[[int], Prompt]
) -> Load:
    return Load(
        target.url,
        target.dialect,
        requests,
        level,
        sweep.max_tokens,
        target.model,
        rate=sweep.rate,
        prompt=prompt,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if not value or not base else f"{value / base:.2f}x"


def report(summary: dict[str, Any]) -> str:
    """The run as markdown: per scenario, one row per (concurrency, target), with ratios to the
    first target at the same concurrency."""
    machine = summary["machine"]
    lines = [
        "# mlxgate bench",
        "",
        f"{machine['platform']}, {machine['cpus']} CPUs ({machine.get('cpu', 'not recorded')}); "
        f"load average {machine['load_before']:.2f} before, {machine['load_after']:.2f} after. "
        "Tokens are counted by the servers' usage.",
        "",
        "Targets: "
        + ", ".join(f"`{t['name']}` ({t['url']}, {t['dialect']})" for t in summary["targets"]),
    ]
    if (sweep := summary["sweep"]) is not None:
        arrival = f"Poisson arrivals at {sweep['rate']}/s" if sweep["rate"] else "a closed loop"
        lines += [
            "",
            f"## Concurrency sweep: {arrival}, {sweep['requests_per_client']} requests per "
            f"client, {sweep['max_tokens']} output tokens asked",
            "",
            *_table(summary, "sweep"),
        ]
    if (replay := summary["replay"]) is not None:
        when = "each once the one before has answered" if replay["staggered"] else "at once"
        traces = ", ".join(f"`{path}`" for path in replay["traces"])
        lines += [
            "",
            f"## Agent replay: {replay['sessions']} sessions {when} from {traces}",
            "",
            *_table(summary, "agent"),
            "",
            "TTFT p50 by turn, ms (prompt tokens by the server's count):",
            "",
        ]
        lines += [
            f"- {r['target']}: "
            + ", ".join(
                f"{_ms(ttft)} ({'-' if tokens is None else f'{tokens:,.0f}'})"
                for ttft, tokens in zip(
                    r["turn_ttft_s_p50"], r["turn_prompt_tokens_p50"], strict=True
                )
            )
            for r in summary["runs"]
            if r["scenario"] == "agent"
        ]
    for name in summary["scenarios"]:
        lines += ["", f"## {TITLES[name]}", "", *_table(summary, name), ""]
        lines += [
            f"- {r['target']}: {_FIGURES[name](r['scenario_figures'])}"
            for r in summary["runs"]
            if r["scenario"] == name and "scenario_figures" in r
        ]
    if summary["plots"] is None:
        lines += ["", "(No plots: `pip install 'mlxgate[bench]'` adds matplotlib.)"]
    else:
        lines += ["", "## Plots", ""]
        lines += [f"![{plots.TITLES[name]}]({name})" for name in summary["plots"]]
    failures = [r for r in summary["runs"] if r["failures"]]
    if failures:
        lines += ["", "Failures by kind:", ""]
        lines += [
            f"- {r['target']}, {r['scenario']} at C={r['concurrency']}: "
            + "; ".join(
                f"{count} {kind} (the first: {_quoted(r['failure_examples'][kind])})"
                for kind, count in r["failures"].items()
            )
            for r in failures
        ]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    """`text` as one markdown code span, whatever backticks and newlines it holds."""
    return "`" + " ".join(text.replace("`", "'").split()) + "`"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _table(summary: dict[str, Any], scenario: str) -> list[str]:
    lines = [
        "| C | target | requests | failed | prompt tokens p50 | out tok/s | ratio "
        "| per stream tok/s | goodput tok/s "
        "| TTFT p50 / p95 / p99 (ms) | ratio | ITL p50 / p95 / p99 / max (ms) | e2e p50 (ms) "
        "| cached | CPU s / token |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    first = summary["targets"][0]["name"]
    runs = [r for r in summary["runs"] if r["scenario"] == scenario]
    runs.sort(key=lambda r: r["concurrency"])
    for run_ in runs:
        base = next(
            r for r in runs if r["target"] == first and r["concurrency"] == run_["concurrency"]
        )
        ttft, itl = run_["ttft_s"], run_["itl_s"]
        cached = "-" if run_["cached_share"] is None else f"{100 * run_['cached_share']:.0f}%"
        cpu = run_["cpu_s_per_output_token"]
        lines.append(
            f"| {run_['concurrency']} | {run_['target']} | {run_['requests']} | {run_['failed']} "
            f"| {_count(run_.get('prompt_tokens_p50'))} | {run_['output_tok_s']:.1f} "
            f"| {_ratio(run_['output_tok_s'], base['output_tok_s'])} "
            f"| {run_['stream_tok_s_p50'] or 0:.1f} | {run_['goodput_tok_s']:.1f} "
            f"| {_ms(ttft['p50'])} / {_ms(ttft['p95'])} / {_ms(ttft['p99'])} "
            f"| {_ratio(ttft['p50'], base['ttft_s']['p50'])} "
            f"| {_ms(itl['p50'])} / {_ms(itl['p95'])} / {_ms(itl['p99'])} / {_ms(itl['max'])} "
            f"| {_ms(run_['e2e_s']['p50'])} | {cached} "
            f"| {'-' if cpu is None else f'{cpu:.4f}'} |"
        )
    return lines


def read_records(path: Path) -> list[Record]:
    """The records of a run directory's `records.jsonl` (times from the run's start)."""
    with path.open() as lines:
        return [Record.from_json(json.loads(line)) for line in lines]


TITLES = {
    "long": "Long prompts at once: how long each waits for its first token",
    "hol": "Head-of-line: the gaps of running streams while a long prompt lands",
    "prefix": "Prefix reuse: a long system prompt asked about twice",
    "disconnect": "Disconnect: the server's CPU after the client goes",
    "edit": "Edit: one client asking for source files back with a rename",
}


def _hol(figures: dict[str, Any]) -> str:
    return (
        f"longest gap during the {figures['prefill_s']:.2f} s prefill of "
        f"{figures['long_prompt_tokens']} tokens {_ms(figures['max_gap_during_s'])} ms against a "
        f"median step's gap of {_ms(figures['median_gap_s'])} ms "
        f"({_ratio(figures['max_gap_during_s'], figures['median_gap_s'])}); streams still "
        f"decoding at its end: {figures['streams_alive']}"
    )


def _prefix(figures: dict[str, Any]) -> str:
    return (
        f"{figures['prompt_tokens']} prompt tokens; TTFT {_ms(figures['ttft_first_s'])} ms, then "
        f"{_ms(figures['ttft_second_s'])} ms "
        f"({_ratio(figures['ttft_second_s'], figures['ttft_first_s'])}); "
        + (
            "the server does not report reused tokens"
            if figures["cached_tokens_second"] is None
            else f"the second reused {figures['cached_tokens_second']} tokens"
        )
    )


def _disconnect(figures: dict[str, Any]) -> str:
    if "skipped" in figures:
        return f"skipped: {figures['skipped']}"

    def idle(part: dict[str, Any]) -> str:
        if part["idle_after_s"] is None:
            return f"still busy {part['observed_s']:.0f} s after"
        return f"idle {part['idle_after_s']:.2f} s after"

    return (
        f"closed mid-decode: {idle(figures['decode'])}; closed mid-prefill: "
        f"{idle(figures['prefill'])}"
    )


def _edit(figures: dict[str, Any]) -> str:
    decode = figures["decode_tok_s"]
    line = f"decode {'-' if decode is None else f'{decode:.1f}'} tok/s after the first token; "
    speculation = figures["speculation"]
    if speculation is None:
        return line + "no speculative-decoding counters on /metrics"
    passes, drafted, kept = (speculation[name] for name in SPECULATION_COUNTERS)
    if not passes:
        return line + "no verify passes (speculation off)"
    return (
        line + f"{kept:.0f} of {drafted:.0f} guessed tokens kept ({100 * kept / drafted:.0f}%), "
        f"{kept / passes:.2f} per verify pass"
    )


_FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "hol": _hol,
    "prefix": _prefix,
    "disconnect": _disconnect,
    "edit": _edit,
}
