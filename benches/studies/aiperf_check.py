"""`mlxgate bench` against NVIDIA's AIPerf on one shared scenario: do the two tools measure the
same server the same way?

    PYTHONPATH=benches .venv/bin/python benches/studies/aiperf_check.py \
        [--concurrency 8] [--requests 32] [--rounds 2]

One mlxgate server on the embedded model (prefix cache off, so no round reuses another's
prompts; one BLAS thread, see main), the same story prompts, C streaming chat clients in a
closed loop, 128 output tokens asked, greedy, tokens counted by the server's usage in both.
The tools take turns, round after round (the machine's speed drifts), and the report gives
each round's TTFT p50 and output tok/s and the ratio of the two tools' medians. AIPerf (PyPI
`aiperf`) runs in an environment of its own made by uv, with the model's own tokenizer; it
needs the network once, to install.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import log, publish

from mlxgate.bench.load import story_prompt
from mlxgate.bench.spawn import EXPORT_DIR, Server, free_port, mlxgate_command
from mlxgate.models.export import export

BENCHES = Path(__file__).resolve().parents[1]
UV = BENCHES.parent / ".tools" / "bin" / "uv"
AIPERF = "aiperf==0.13.0"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 128


def run_mlxgate_bench(url: str, concurrency: int, requests: int, out: Path) -> dict[str, float]:
    """One sweep level of `mlxgate bench`: TTFT p50 (s) and output tok/s."""
    subprocess.run(
        [
            sys.executable, "-m", "mlxgate", "bench", "--target",
            f"mlxgate={url},dialect=openai,model={MODEL}", "--scenarios", "sweep",
            "--concurrency", str(concurrency), "--requests-per-client",
            str(requests // concurrency), "--max-tokens", str(MAX_TOKENS), "--out", str(out),
        ],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    (sweep,) = json.loads((out / "summary.json").read_text())["runs"]
    ttfts = [
        record["ttft_s"]
        for record in map(json.loads, (out / "records.jsonl").read_text().splitlines())
        if record["scenario"] == "sweep" and record["ttft_s"] is not None
    ]
    return {
        "ttft_p50_s": sweep["ttft_s"]["p50"],
        "ttft_mean_s": statistics.fmean(ttfts),
        "output_tok_s": sweep["output_tok_s"],
        "failed": sweep["failed"],
        "requests": sweep["requests"],
    }


def run_aiperf(
    url: str, concurrency: int, requests: int, prompts: Path, out: Path
) -> dict[str, float]:
    """AIPerf's profile of the same load: TTFT p50 (s) and output tok/s."""
    subprocess.run(
        [
            str(UV), "run", "--no-project", "--with", AIPERF, "aiperf", "profile",
            "--model", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(EXPORT_DIR), "--input-file", str(prompts),
            "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", "1", "--output-tokens-mean", str(MAX_TOKENS),
            "--extra-inputs", "temperature:0", "--use-server-token-count",
            # As few of its own processes as it allows: this machine has 2 cores.
            "--workers-max", "1", "--record-processors", "1", "--no-server-metrics",
            "--ui-type", "none", "--artifact-dir", str(out),
        ],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = json.loads((out / "profile_export_aiperf.json").read_text())  # the measured phase
    ttft = metrics["time_to_first_token"]
    scale = {"ms": 1e-3, "s": 1.0, "ns": 1e-9}[ttft.get("unit", "ms")]
    return {
        "ttft_p50_s": ttft["p50"] * scale,
        "ttft_mean_s": ttft["avg"] * scale,
        "output_tok_s": metrics["output_token_throughput"]["avg"],
        "failed": metrics.get("error_request_count", {}).get("avg", 0),
        "requests": metrics["request_count"]["avg"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = BENCHES / ".cache" / f"aiperf-check-{stamp}"
    work.mkdir(parents=True)
    export(EXPORT_DIR)  # the tokenizer AIPerf reads
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"text": story_prompt(i).user}) + "\n" for i in range(args.requests))
    )
    # One BLAS thread: AIPerf's timing process keeps a core busy polling, and OpenBLAS threads
    # that wait for each other on a shared core make a decode step 30x slower (2.2 s a token
    # here). The server keeps one core, the tools the other, and both tools see the same server.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    port = free_port()
    command = mlxgate_command(port, ["--prefix-cache-mb", "0"])
    server = Server("mlxgate", command, port, work / "server.log")
    server.start()
    rows: dict[str, list[dict[str, float]]] = {"mlxgate bench": [], "AIPerf": []}
    try:
        for number in range(args.rounds):
            for tool in rows if number % 2 == 0 else reversed(rows):
                log(f"round {number + 1}: {tool}")
                out = work / f"{tool.replace(' ', '-')}-{number}"
                if tool == "AIPerf":
                    row = run_aiperf(server.url, args.concurrency, args.requests, prompts, out)
                else:
                    row = run_mlxgate_bench(server.url, args.concurrency, args.requests, out)
                rows[tool].append(row)
    finally:
        server.stop()

    def median(tool: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[tool])

    lines = [
        f"# mlxgate bench against AIPerf, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `python benches/studies/aiperf_check.py --concurrency {args.concurrency} "
        f"--requests "
        f"{args.requests} --rounds {args.rounds}` ({AIPERF}). One mlxgate server on the "
        "embedded model, prefix cache off, one BLAS thread (AIPerf keeps a core busy); "
        f"{args.requests} story prompts, {args.concurrency} streaming chat clients, "
        f"{MAX_TOKENS} output tokens asked, greedy, tokens by the "
        "server's usage. The tools take turns.",
        "",
        "| round | tool | requests | failed | TTFT p50 (ms) | TTFT mean (ms) | output tok/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for number in range(args.rounds):
        for tool, tool_rows in rows.items():
            row = tool_rows[number]
            lines.append(
                f"| {number + 1} | {tool} | {row['requests']:.0f} | {row['failed']:.0f} "
                f"| {row['ttft_p50_s'] * 1000:.0f} | {row['ttft_mean_s'] * 1000:.0f} "
                f"| {row['output_tok_s']:.1f} |"
            )
    ratios = {
        key: median("mlxgate bench", key) / median("AIPerf", key)
        for key in ("ttft_p50_s", "ttft_mean_s", "output_tok_s")
    }
    lines += [
        "",
        f"Medians over the rounds, mlxgate bench / AIPerf: TTFT p50 {ratios['ttft_p50_s']:.3f}, "
        f"TTFT mean {ratios['ttft_mean_s']:.3f}, output tok/s {ratios['output_tok_s']:.3f} "
        "(agreement within 5% is 0.95-1.05). mlxgate bench's p50 is the nearest-rank one, "
        "AIPerf's interpolates between the two middle values; with TTFTs in waves (the first "
        "C requests start at once) the two can differ by more than the tools do, so the mean "
        "is given too.",
    ]
    publish(lines, BENCHES / "results", "aiperf-check")


if __name__ == "__main__":
    main()
