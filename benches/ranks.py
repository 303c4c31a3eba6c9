"""What does serving one model across 2 ranks cost the engine in synchronisation?

    .venv/bin/python benches/ranks.py [--rounds 2] [--max-tokens 64]

Writes a random-weight mlx-lm llama at SmolLM2-135M's shape (30 layers, hidden 576), but with
head counts 2 ranks divide (8 attention heads of 72, 4 key/value heads), its weights 4-bit
quantized as `mlx_lm.convert -q` does, with the embedded model's tokenizer, into a temporary
directory. The rows of the end-of-sequence tokens in its (tied) embedding are zero, so greedy
replies always run to `--max-tokens`.

Then serves it with `mlxgate serve --ranks 1` and `--ranks 2` (tensor parallel, both ranks on
this machine's cores), one server at a time, interleaved (1, 2, 1, 2, ...: the machine's speed
drifts), speculative decoding off on both (a random model's repetitive replies would make it
accept drafts no real model does). Each server takes, after a warm-up request, C=1 then C=32
greedy streamed clients in a closed loop. Both ranks share the same cores, so this measures
the overhead of ranks, not a speed-up: output tok/s of each and their ratio, the mean engine
step (busy seconds / steps from /metrics), and for 2 ranks the seconds rank 0 spent sharing
its plan per engine step (`mlxgate_rank_share_seconds`), against a target of 1 ms. Before the
servers and after them, two bare processes share a plan in a loop (`RankGroup.share`, no model):
the collective's own cost, apart from a rank waiting for the other to finish its part of a step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from report import log, publish

from mlxgate.bench.load import Load, run
from mlxgate.bench.spawn import Server, free_port, mlxgate_command, stop_all

BENCHES = Path(__file__).resolve().parent
SHARE_TARGET_MS = 1.0
MODEL_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "head_dim": 72,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
COUNTERS = {
    "steps": "mlxgate_engine_steps_total",
    "busy_s": "mlxgate_engine_busy_s_total",
    "plan_s": "mlxgate_engine_plan_s_total",
    "shares": "mlxgate_rank_shares",
    "share_s": "mlxgate_rank_share_seconds",
}


def write_model(out: Path, group_size: int) -> None:
    """The random-weight, 4-bit model directory, with the embedded model's tokenizer files."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import quantize_model, save_config, save_model

    from mlxgate.models import default_model_path
    from mlxgate.models.gguf import converted

    tokenizer_dir = converted(default_model_path())
    eos_ids = json.loads((tokenizer_dir / "generation_config.json").read_text())["eos_token_id"]
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(MODEL_CONFIG))
    embedding = model.model.embed_tokens.weight
    embedding[mx.array(eos_ids)] = 0.0
    model.model.embed_tokens.weight = embedding
    mx.eval(model.parameters())
    quantized, config = quantize_model(model, dict(MODEL_CONFIG), group_size=group_size, bits=4)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, quantized)
    save_config(config, out / "config.json")
    for path in tokenizer_dir.iterdir():
        if path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)


def scrape(url: str) -> dict[str, float]:
    """The counters this bench reads, from rank 0's /metrics (absent ones are not there)."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_and_labels, value = line.rsplit(" ", 1)
        name = name_and_labels.split("{", 1)[0]
        for key, metric in COUNTERS.items():
            if name == metric:
                values[key] = values.get(key, 0.0) + float(value)
    return values


@dataclass(frozen=True)
class Measure:
    ranks: int
    round: int
    clients: int
    tok_s: float
    output_tokens: int
    wall_s: float
    steps: float
    busy_s: float
    plan_s: float
    shares: float | None
    share_s: float | None
    load_average: float

    @property
    def step_ms(self) -> float:
        return 1000 * self.busy_s / self.steps

    @property
    def plan_share(self) -> float:
        """Rank 0's time planning steps, a share of the steps' time."""
        return self.plan_s / self.busy_s

    @property
    def share_ms_per_step(self) -> float | None:
        return None if self.share_s is None else 1000 * self.share_s / self.steps

    @property
    def shares_per_step(self) -> float | None:
        return None if self.shares is None else self.shares / self.steps


def closed_loop(url: str, clients: int, requests: int, max_tokens: int) -> tuple[int, float]:
    """`requests` greedy streams, `clients` at a time: output tokens and wall seconds."""
    load = Load(url, "openai", requests, clients, max_tokens, model="model")
    started = time.monotonic()
    records = asyncio.run(run(load))
    wall = time.monotonic() - started
    if failed := [r.error for r in records if r.error]:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    short = [r.output_tokens for r in records if r.output_tokens != max_tokens]
    if short:
        log(f"warning: {len(short)} replies not {max_tokens} tokens long: {short[:5]}")
    return sum(r.output_tokens or 0 for r in records), wall


def measure_server(
    model_dir: Path, ranks: int, round_: int, args: argparse.Namespace, logs: Path
) -> list[Measure]:
    port = free_port()
    flags = ["--model", str(model_dir), "--ranks", str(ranks), "--max-draft-tokens", "0"]
    log_path = logs / f"ranks{ranks}-round{round_}.log"
    env = None
    if ranks > 1 and args.rank_kernel_threads:
        env = {**os.environ, "MLXGATE_KERNEL_THREADS": str(args.rank_kernel_threads)}
    server = Server("mlxgate", mlxgate_command(port, flags), port, log_path, env=env)
    log(f"round {round_}: starting {ranks} rank(s)")
    server.start()
    measures = []
    try:
        closed_loop(server.url, 1, 1, args.max_tokens)
        for clients in args.clients:
            requests = clients * args.waves
            before = scrape(server.url)
            output_tokens, wall = closed_loop(server.url, clients, requests, args.max_tokens)
            after = scrape(server.url)
            delta = {key: after[key] - before[key] for key in after}
            measure = Measure(
                ranks=ranks,
                round=round_,
                clients=clients,
                tok_s=output_tokens / wall,
                output_tokens=output_tokens,
                wall_s=wall,
                steps=delta["steps"],
                busy_s=delta["busy_s"],
                plan_s=delta["plan_s"],
                shares=delta.get("shares"),
                share_s=delta.get("share_s"),
                load_average=os.getloadavg()[0],
            )
            share = measure.share_ms_per_step
            log(
                f"  {ranks} rank(s) C={clients}: {measure.tok_s:.1f} tok/s, step "
                f"{measure.step_ms:.2f} ms, plan {100 * measure.plan_share:.2f}% of it"
                + ("" if share is None else f", share {share:.3f} ms/step")
            )
            measures.append(measure)
    finally:
        server.stop()
        if server.log_path.exists() and "Traceback" in server.log():
            log(f"a traceback in {server.log_path}")
    return measures


def share_loop(shares: int) -> None:
    """One rank of `share_latency`'s pair: prints its mean seconds a share."""
    import mlx.core as mx

    from mlxgate.engine.lockstep import RankGroup

    group = RankGroup(mx.distributed.init(strict=True))
    plan = {"running": list(range(32)), "taken": [], "state": "0123456789abcdef" * 4}
    for _ in range(shares // 10):
        group.share(lambda: plan)
    before = group.share_s
    for _ in range(shares):
        group.share(lambda: plan)
    print((group.share_s - before) / shares)


def share_latency(shares: int = 2000) -> float:
    """Seconds one share takes between 2 ranks with no model and no engine (rank 0's): the
    collective's own cost on this machine as it is now."""
    ports = [free_port(), free_port()]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as hostfile:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], hostfile)
        hostfile.flush()
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--share-loop", str(shares)],
                env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile.name},
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [process.communicate(timeout=300)[0] for process in ranks]
    return float(outputs[0].split()[-1])


def mean(values: list[float]) -> float:
    return statistics.mean(values)


def spread(values: list[float], digits: int) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def report(
    measures: list[Measure], share_alone_s: list[float], args: argparse.Namespace, elapsed_s: float
) -> list[str]:
    lines = [
        f"# Two ranks: the engine's synchronisation ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/ranks.py --rounds {args.rounds} --clients {','.join(map(str, args.clients))} "
        f"--max-tokens {args.max_tokens} --waves "
        f"{args.waves} --group-size {args.group_size}"
        + (f" --rank-kernel-threads {args.rank_kernel_threads}" if args.rank_kernel_threads else "")
        + "`: a random-weight 4-bit llama at "
        "SmolLM2-135M's shape (8 heads of 72, 4 KV heads), `mlxgate serve --ranks 1` against "
        "`--ranks 2` (tensor parallel, both ranks on this machine's 2 cores), "
        "`--max-draft-tokens 0`, one server at a time, interleaved "
        f"{', '.join(['1, 2'] * args.rounds)}. Per scenario: C greedy OpenAI streams in a closed "
        f"loop, {args.waves} requests per client, {args.max_tokens} tokens each, after a warm-up "
        f"request. Whole run: {elapsed_s / 60:.1f} min.",
        "",
        "Step: busy seconds / steps (/metrics, over the scenario). Share: seconds rank 0 spent "
        "sharing with rank 1 (`mlxgate_rank_share_seconds`) per engine step; target "
        f"< {SHARE_TARGET_MS:g} ms. Plan: rank 0's time making the steps' plans "
        "(`mlxgate_engine_plan_s_total`: intake, preemption, guesses, the scheduler's prefill "
        "plan) over the steps' time, 1 rank / 2 ranks; target < 2%. Means over rounds; each "
        "round in parentheses.",
        "",
        "| C | tok/s 1 rank | tok/s 2 ranks | 2/1 | step 1 rank | step 2 ranks | plan "
        "| share / step | shares / step | target |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for clients in args.clients:
        one = [m for m in measures if m.clients == clients and m.ranks == 1]
        two = [m for m in measures if m.clients == clients and m.ranks == 2]
        tok_s_1 = [m.tok_s for m in one]
        tok_s_2 = [m.tok_s for m in two]
        step_1 = [m.step_ms for m in one]
        step_2 = [m.step_ms for m in two]
        share = [m.share_ms_per_step or 0.0 for m in two]
        shares = [m.shares_per_step or 0.0 for m in two]
        plan_1 = [100 * m.plan_share for m in one]
        plan_2 = [100 * m.plan_share for m in two]
        met = "met" if mean(share) < SHARE_TARGET_MS else "**missed**"
        lines.append(
            f"| {clients} | {mean(tok_s_1):.1f} ({spread(tok_s_1, 1)}) "
            f"| {mean(tok_s_2):.1f} ({spread(tok_s_2, 1)}) "
            f"| {mean(tok_s_2) / mean(tok_s_1):.2f} "
            f"| {mean(step_1):.2f} ms ({spread(step_1, 2)}) "
            f"| {mean(step_2):.2f} ms ({spread(step_2, 2)}) "
            f"| {mean(plan_1):.2f}% / {mean(plan_2):.2f}% "
            f"| {mean(share):.3f} ms ({spread(share, 3)}) "
            f"| {mean(shares):.1f} | {met} |"
        )
    lines += [
        "",
        "A share with no model (2 processes sharing a plan of 32 rows in a loop, before the "
        "servers and after them): "
        + ", ".join(f"{1000 * s:.3f} ms" for s in share_alone_s)
        + ". Share / step over shares / step in the table above is the same figure "
        "within serving.",
        "",
        "## Each scenario",
        "",
        "Load: the machine's 1-minute load average as the scenario ended (other work on the "
        "machine shows in it).",
        "",
        "| round | ranks | C | output tokens | wall | tok/s | steps | busy | shares | share "
        "| load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in measures:
        shares_cell = "-" if m.shares is None else f"{m.shares:.0f}"
        share_s_cell = "-" if m.share_s is None else f"{m.share_s:.3f} s"
        lines.append(
            f"| {m.round} | {m.ranks} | {m.clients} | {m.output_tokens} | {m.wall_s:.1f} s "
            f"| {m.tok_s:.1f} | {m.steps:.0f} | {m.busy_s:.2f} s | {shares_cell} | {share_s_cell} "
            f"| {m.load_average:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="pairs of 1 rank, 2 ranks")
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 32])
    parser.add_argument("--waves", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=32, choices=(32, 64))
    parser.add_argument(
        "--rank-kernel-threads",
        type=int,
        help="MLXGATE_KERNEL_THREADS for each of the 2 ranks (default: the kernels' own, a thread "
        "per core in each rank)",
    )
    parser.add_argument("--out", type=Path, default=BENCHES / "results")
    parser.add_argument("--share-loop", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.share_loop:
        share_loop(args.share_loop)
        return

    started = time.monotonic()
    measures: list[Measure] = []
    logs = Path(tempfile.mkdtemp(prefix="mlxgate-ranks-bench-logs-"))
    log(f"server logs in {logs}")
    try:
        with tempfile.TemporaryDirectory(prefix="mlxgate-ranks-bench-") as work:
            model_dir = Path(work) / "model"
            log(f"writing the model to {model_dir}")
            write_model(model_dir, args.group_size)
            share_alone_s = [share_latency()]
            log(f"a share with no model: {1000 * share_alone_s[0]:.3f} ms")
            for round_ in range(1, args.rounds + 1):
                for ranks in (1, 2):
                    measures += measure_server(model_dir, ranks, round_, args, logs)
            share_alone_s.append(share_latency())
            log(f"a share with no model: {1000 * share_alone_s[-1]:.3f} ms")
    finally:
        stop_all()
    publish(report(measures, share_alone_s, args, time.monotonic() - started), args.out, "ranks")


if __name__ == "__main__":
    main()
