"""Serving benchmark: mlxgate and mlx_lm.server on the same model, scenario by scenario, one run.

    .venv/bin/python benches/serving.py                       # everything (about an hour here)
    .venv/bin/python benches/serving.py --quick               # smoke test, small sizes
    .venv/bin/python benches/serving.py --scenarios c1,c32 --servers mlxgate,mlx_lm

Every (scenario, server, dialect) gets a fresh server: start, one warm-up request, the load,
stop. The markdown table goes to stdout and to benches/results/serving-<timestamp>.md, the
raw figures to the .json beside it. See benches/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bound
import httpx
import scenarios
from export_model import DEFAULT_DIR
from prometheus_client.parser import text_string_to_metric_families
from report import log
from scenarios import Sizes
from servers import (
    DIALECTS,
    LABELS,
    MODEL_NAMES,
    PYTHON,
    Server,
    blas,
    display,
    free_port,
    server_command,
    stop_all,
)

from mlxgate.bench.load import make_client, send_prompt, story_prompt
from mlxgate.bench.records import PATHS, Record
from mlxgate.bench.target import Target

BENCHES = Path(__file__).resolve().parent
SCENARIOS = ("edit", "c1", "c8", "c32", "long", "hol", "prefix", "disconnect")
THROUGHPUT = ("edit", "c1", "c8", "c32")
PEER = "mlx_lm"
PLAIN = "mlxgate_plain"
WIRE_DIALECTS = ("anthropic", "openai")
SPECULATION_COUNTERS = ("verify_passes", "drafted_tokens", "accepted_tokens")


def _child_json(args: list[str]) -> dict[str, Any]:
    """Run a bench script in its own process (MLX and the model stay out of this one)."""
    out = subprocess.run([PYTHON, *args], cwd=BENCHES.parent, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_export(model_dir: Path) -> None:
    if not (model_dir / "model.safetensors").exists():
        log(f"exporting the model for mlx_lm.server to {model_dir}")
        subprocess.run(
            [PYTHON, str(BENCHES / "export_model.py"), "--out", str(model_dir)],
            cwd=BENCHES.parent,
            check=True,
            stdout=subprocess.DEVNULL,
        )


async def _run_scenario(name: str, target: Target, sizes: Sizes, nonce: str) -> dict[str, Any]:
    if name == "edit":
        return await scenarios.edit(target, sizes)
    if name in THROUGHPUT:
        return await scenarios.concurrency(target, sizes, int(name[1:]))
    if name == "long":
        return await scenarios.long_prompts(target, sizes, nonce)
    if name == "hol":
        return await scenarios.head_of_line(target, sizes, nonce)
    if name == "prefix":
        return await scenarios.prefix(target, sizes, nonce)
    if name == "disconnect":
        return await scenarios.disconnect(target, sizes, nonce)
    raise ValueError(f"unknown scenario {name!r}")


async def _warm_up(target: Target) -> Record:
    async with make_client(1, 600.0) as client:
        return await send_prompt(
            client,
            target.url,
            target.dialect,
            story_prompt(99),
            8,
            model=target.model,
            timeout_s=600.0,
        )


def run_one(
    scenario: str, server_name: str, dialect: str, args: argparse.Namespace, sizes: Sizes
) -> dict[str, Any]:
    """Start the server, warm it up, run the scenario, stop it. Returns the row."""
    port = free_port()
    extra = shlex.split(args.mlx_lm_args if server_name == PEER else args.mlxgate_args)
    command = server_command(server_name, port, args.model_dir, extra)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_path = BENCHES / ".cache" / "logs" / f"{stamp}-{scenario}-{server_name}-{dialect}.log"
    server = Server(server_name, command, port, log_path)
    row: dict[str, Any] = {"server": server_name, "dialect": dialect, "log": str(log_path)}
    try:
        log(f"{scenario}: starting {LABELS[server_name]} ({dialect}) on port {port}")
        server.start()
        row["blas"] = blas(server.pid)
        target = Target(server_name, server.url, dialect, server.pid, MODEL_NAMES[server_name])
        warm = asyncio.run(_warm_up(target))
        if warm.status == 404:
            row["skipped"] = f"{LABELS[server_name]} answers 404 on {PATHS[dialect]}"
            return row
        if not warm.ok:
            row["error"] = f"warm-up failed: {warm.error}"
            return row
        log(f"{scenario}: running on {LABELS[server_name]} ({dialect})")
        started = time.monotonic()
        row.update(asyncio.run(_run_scenario(scenario, target, sizes, uuid.uuid4().hex[:8])))
        if server_name != PEER:
            row.update(speculation_figures(server.url))
        figures = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
        log(f"{scenario}: done in {time.monotonic() - started:.0f} s: {figures}")
    except Exception as exc:  # one failed run must not lose the others' figures
        row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{scenario}: {LABELS[server_name]} ({dialect}) failed: {row['error']}")
    finally:
        server.stop()
    return row


def speculation_figures(url: str) -> dict[str, float]:
    """Speculative decoding's counters from the server's /metrics, after the scenario."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = {f"mlxgate_engine_{name}": name for name in SPECULATION_COUNTERS}
    return {
        wanted[family.name]: family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.name in wanted
    }


# The report --------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _who(row: dict[str, Any]) -> str:
    return f"{LABELS[row['server']]} ({row['dialect']})"


def _peer(rows: list[dict[str, Any]], server: str = PEER) -> dict[str, Any] | None:
    return next((r for r in rows if r["server"] == server and "error" not in r), None)


def _kept_per_pass(row: dict[str, Any]) -> str:
    passes = row.get("verify_passes")
    return f"{row['accepted_tokens'] / passes:.2f}" if passes else "-"


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in lines),
    ]


def _failed_rows(
    rows: list[dict[str, Any]], width: int, lead: tuple[str, ...] = ()
) -> list[list[str]]:
    """Rows for runs that were skipped or failed as a whole, the reason in the second column."""
    out = []
    for row in rows:
        reason = row.get("skipped") or row.get("error")
        if reason:
            kind = "skipped" if "skipped" in row else "error"
            cells = [*lead, _who(row), f"**{kind}**: {reason}"]
            out.append(cells + [""] * (width - len(cells)))
    return out


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "skipped" not in r and "error" not in r]


def throughput_table(
    results: dict[str, list[dict[str, Any]]], measured: dict[str, Any] | None
) -> list[str]:
    header = [
        "scenario",
        "server",
        "requests",
        "failed",
        "output tok/s",
        "vs mlx_lm.server",
        "vs no speculation",
        "decode tok/s",
        "goodput tok/s",
        "kept guesses / pass",
        "bound tok/s",
        "% of bound",
        "out tok/req",
        "TTFT p50 / p95 / p99 ms",
        "ITL p50 / p95 / max ms",
    ]
    lines = []
    for scenario in THROUGHPUT:
        rows = results.get(scenario, [])
        peer, plain = _peer(_ok(rows)), _peer(_ok(rows), PLAIN)

        def ratio(row: dict[str, Any], base: dict[str, Any] | None) -> str:
            if base is None or base is row or not base["output_tok_s"]:
                return ""
            return _x(row["output_tok_s"] / base["output_tok_s"])

        for row in _ok(rows):
            bound_cell = share = "-"
            if scenario == "c32" and measured:
                limit = bound.c32_bound(
                    measured,
                    requests=row["requests"],
                    concurrency=row["concurrency"],
                    prompt_tokens=row["mean_input_tokens"] or 70,
                    output_tokens=row["max_tokens"],
                )["bound_tok_s"]
                bound_cell, share = f"{limit:.1f}", f"{100 * row['output_tok_s'] / limit:.0f}%"
            ttft = " / ".join(_ms(row.get(f"ttft_{q}_s")) for q in ("p50", "p95", "p99"))
            lines.append(
                [
                    scenario if scenario == "edit" else f"C={row['concurrency']}",
                    _who(row),
                    str(row["requests"]),
                    str(row["failed"]),
                    f"{row['output_tok_s']:.1f}",
                    ratio(row, peer),
                    ratio(row, plain) if row["server"] != PEER else "",
                    f"{row.get('decode_tok_s', 0.0):.1f}",
                    f"{row.get('goodput_tok_s', 0.0):.1f}",
                    _kept_per_pass(row),
                    bound_cell,
                    share,
                    f"{row['mean_output_tokens']:.0f}",
                    ttft,
                    f"{_ms(row['itl_p50_s'])} / {_ms(row['itl_p95_s'])} / {_ms(row['itl_max_s'])}",
                ]
            )
        lines += _failed_rows(rows, len(header), (scenario,))
    return _table(header, lines)


def long_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "server",
        "requests",
        "failed",
        "prompt tok",
        "TTFT p50 s",
        "TTFT p95 s",
        "p50 vs mlx_lm.server",
        "wall s",
    ]
    peer = _peer(_ok(rows))
    lines = []
    for row in _ok(rows):
        vs = (
            row["ttft_p50_s"] / peer["ttft_p50_s"]
            if peer and peer["ttft_p50_s"] and row["ttft_p50_s"]
            else None
        )
        lines.append(
            [
                _who(row),
                str(row["requests"]),
                str(row["failed"]),
                f"{row['mean_input_tokens']:.0f}",
                _s(row["ttft_p50_s"]),
                _s(row["ttft_p95_s"]),
                _x(vs) if row["server"] != PEER else "",
                f"{row['wall_s']:.1f}",
            ]
        )
    return _table(header, lines + _failed_rows(rows, len(header)))


def hol_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "server",
        "long prompt tok",
        "its prefill s",
        "max gap during it ms",
        "median gap ms",
        "ratio",
        "streams alive",
        "failed",
    ]
    lines = [
        [
            _who(r),
            str(r["long_prompt_tokens"]),
            _s(r["prefill_s"]),
            _ms(r["max_gap_during_s"]),
            _ms(r["median_gap_s"]),
            _x(r["ratio"]),
            f"{r['streams_alive']} / {r['streams']}",
            str(r["failed"]),
        ]
        for r in _ok(rows)
    ]
    return _table(header, lines + _failed_rows(rows, len(header)))


def prefix_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "server",
        "prompt tok",
        "TTFT 1st ms",
        "TTFT 2nd ms",
        "2nd / 1st",
        "cached tok (2nd)",
        "failed",
    ]
    lines = [
        [
            _who(r),
            str(r["prompt_tokens"]),
            _ms(r["ttft_1_s"]),
            _ms(r["ttft_2_s"]),
            _x(r["ratio"]),
            str(r["cached_tokens_2"]),
            str(r["failed"]),
        ]
        for r in _ok(rows)
    ]
    return _table(header, lines + _failed_rows(rows, len(header)))


def disconnect_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "server",
        "closed",
        "in prefill",
        "CPU before close (cores)",
        "idle after close s",
        "note",
    ]
    lines = []
    for r in _ok(rows):
        for case, label in (("decode", "mid-decode"), ("prefill", "mid-prefill")):
            c = r[case]
            idle = (
                _s(c["idle_after_s"])
                if c["idle_after_s"] is not None
                else f"> {c['observed_s']:.0f}"
            )
            note = c["error"] or ""
            if case == "prefill" and r["settle_s"] is None:
                note += " server still busy from the first case when this one started"
            busy = (
                "-"
                if c["busy_cores_before_close"] is None
                else f"{c['busy_cores_before_close']:.2f}"
            )
            lines.append(
                [_who(r), label, str(c["closed_in_prefill"]).lower(), busy, idle, note.strip()]
            )
    return _table(header, lines + _failed_rows(rows, len(header)))


def bound_lines(measured: dict[str, Any] | None) -> list[str]:
    if not measured:
        return ["(not measured in this run)"]
    b = bound.c32_bound(measured)
    return bound.format_table(measured, b).splitlines()


def report(
    results: dict[str, list[dict[str, Any]]],
    measured: dict[str, Any] | None,
    args: argparse.Namespace,
    sizes: Sizes,
    load: tuple[str, str],
) -> str:
    out = [
        f"# Serving benchmark, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`  ",
        f"Machine: {os.cpu_count()} cores; load average at start {load[0]}, at end {load[1]}  ",
        f"Sizes: {'quick' if args.quick else 'full'} ({sizes})",
        "",
        "Servers (port chosen per run):",
        "",
    ]
    for name in args.servers:
        extra = args.mlx_lm_args if name == PEER else args.mlxgate_args
        command = server_command(name, "PORT", args.model_dir, shlex.split(extra))
        out.append(f"- {LABELS[name]}: `{display(command)}`")
    blas = {
        f"{LABELS[r['server']]}: {r['blas']}"
        for rows in results.values()
        for r in rows
        if "blas" in r
    }
    out += ["", f"BLAS mapped in the server processes: {', '.join(sorted(blas)) or '-'}", ""]
    if any(s in results for s in THROUGHPUT):
        out += [
            "## Throughput (edit: one client asking for source files back with a rename; C=N: N "
            "concurrent clients, story prompts)",
            "",
            *throughput_table(results, measured),
            "",
        ]
        out += [
            "Targets: edit >= 2.0x mlx_lm.server and >= 1.8x without speculation; C=1 >= 1.0x "
            "without speculation; C=32 zero failures, >= 0.97x without speculation, >= 1.3x "
            f"mlx_lm.server, TTFT p95 <= mlx_lm.server's. Goodput counts the output of replies "
            f"that start within {scenarios.SLO.ttft_s:g} s and take <= "
            f"{scenarios.SLO.itl_s * 1000:.0f} ms per token after the first.",
            "",
        ]
    if "c32" in results:
        out += ["## In-process bound (benches/bound.py)", "", *bound_lines(measured), ""]
    sections = (
        (
            "long",
            "Long prompts (concurrent long prompts, TTFT)",
            long_table,
            "TTFT p50 <= 0.3x mlx_lm.server's.",
        ),
        (
            "hol",
            "Head-of-line (streams decoding while a long prompt is prefilled)",
            hol_table,
            "ratio <= 4x.",
        ),
        (
            "prefix",
            "Prefix reuse (shared long system prompt, 2nd request after the 1st)",
            prefix_table,
            "2nd / 1st <= 0.1x.",
        ),
        (
            "disconnect",
            "Disconnect (server CPU after the client closes)",
            disconnect_table,
            "idle within 0.5 s, also mid-prefill.",
        ),
    )
    for key, title, table, target in sections:
        if key in results:
            out += [f"## {title}", "", *table(results[key]), "", f"Target: {target}", ""]
    return "\n".join(out)


# Orchestration -----------------------------------------------------------------------------


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parse_list(value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(unknown)} (choose from {', '.join(allowed)})"
        )
    return items


def measure_bound(quick: bool, when: str) -> dict[str, Any]:
    log(f"measuring the in-process bound (benches/bound.py), {when} the C=32 runs")
    repeats = "1" if quick else "3"
    return _child_json([str(BENCHES / "bound.py"), "--json", "--repeats", repeats])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios",
        type=lambda v: _parse_list(v, SCENARIOS),
        default=list(SCENARIOS),
        help=f"comma-separated, from {','.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--servers",
        type=lambda v: _parse_list(v, tuple(DIALECTS)),
        default=list(DIALECTS),
        help=f"comma-separated, from {','.join(DIALECTS)} (default: all)",
    )
    parser.add_argument(
        "--dialects",
        type=lambda v: _parse_list(v, WIRE_DIALECTS),
        default=list(WIRE_DIALECTS),
        help="limit the API dialects driven (default: every one a server speaks)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--mlxgate-args", default="", help="extra flags for `mlxgate serve`")
    parser.add_argument("--mlx-lm-args", default="", help="extra flags for mlx_lm.server")
    parser.add_argument("--no-bound", action="store_true", help="skip the in-process bound")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR, help="mlx-lm export dir")
    parser.add_argument("--out-dir", type=Path, default=BENCHES / "results")
    args = parser.parse_args()
    sizes = Sizes.quick() if args.quick else Sizes()
    signal.signal(signal.SIGTERM, _on_sigterm)
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    results: dict[str, list[dict[str, Any]]] = {}
    measured = None
    bound_runs: list[dict[str, Any]] = []
    try:
        ensure_export(args.model_dir)
        unsupported: dict[tuple[str, str], str] = {}
        for scenario in args.scenarios:
            bounded = scenario == "c32" and not args.no_bound
            if bounded:
                bound_runs.append(measure_bound(args.quick, "before"))
                measured = bound.fastest(bound_runs)
            rows = results.setdefault(scenario, [])
            for server_name in args.servers:
                for dialect in DIALECTS[server_name]:
                    if dialect not in args.dialects:
                        continue
                    if reason := unsupported.get((server_name, dialect)):
                        rows.append({"server": server_name, "dialect": dialect, "skipped": reason})
                        continue
                    row = run_one(scenario, server_name, dialect, args, sizes)
                    if "skipped" in row:
                        unsupported[(server_name, dialect)] = row["skipped"]
                    rows.append(row)
            if bounded:
                bound_runs.append(measure_bound(args.quick, "after"))
                measured = bound.fastest(bound_runs)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured so far")
    finally:
        stop_all()
    load_end = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(results, measured, args, sizes, (load_start, load_end))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"serving-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "results": results,
                "bound": measured,
                "bound_runs": bound_runs,
                "sizes": asdict(sizes),
            },
            indent=1,
            default=str,
        )
    )
    print(text)
    log(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
