"""What a long context costs the embedded model: prefill speed and memory at 2k-32k tokens, and
whether it still recalls a fact stated early in a ~12k-token document.

    PYTHONPATH=benches flock /tmp/bench.lock .venv/bin/python benches/studies/context_cost.py \
        [--lengths 2048,8192,16384,32768] [--recall 1000,12000]

The embedded model is loaded as `mlxgate serve` loads it (32,768 tokens: YaRN x4 over its
8,192). One prompt of the longest length is prefilled the way the engine prefills one prompt:
through its model adapter, in its chunks (`--max-prefill-chunk`, 256 tokens), into a fresh
cache of the kinds the model asks for. At each length on the way the report gives:

- prefill tok/s of a prompt that long (its tokens / the time to reach it: the chunks a prompt of
  that length takes), its ratio to the shortest length's, and the tok/s of the last 1,024 tokens
  before it (what a token costs that deep);
- the KV cache: bytes per token and in all; the process's peak memory (MLX's own and RSS).

Recall: a document of stdlib docstrings with one fact stated near its start (a door code), then
a question about it, as one chat turn; the reply is generated greedily, by the served model and,
for comparison, by the same weights with their own unscaled rope. The report quotes each reply.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from report import publish

FACT = (
    "Before the documentation starts, one note for the reader: the door code of the archive "
    "room is 4817."
)
QUESTION = "What is the door code of the archive room? Answer with the number."
CODE = "4817"
# Modules whose docstrings make the filler: plain English prose that says nothing about doors.
FILLER_MODULES = (
    "argparse", "collections", "json", "pathlib", "subprocess", "threading", "logging",
    "unittest", "functools", "itertools", "textwrap", "datetime", "decimal", "fractions",
    "statistics", "email.message", "http.client", "tarfile", "zipfile", "sqlite3", "csv",
    "string", "typing", "asyncio.events", "asyncio.tasks", "shutil", "tempfile", "calendar",
)  # fmt: skip
RECALL_TOKENS = 48
MARGINAL_TOKENS = 1024


@dataclass
class Mark:
    length: int
    seconds: float  # from the first prompt token to this length
    marginal_tok_s: float  # over the last MARGINAL_TOKENS tokens before this length
    kv_bytes: int
    peak_mlx_bytes: int
    peak_rss_bytes: int
    load_average: float  # 1-minute, when the length was reached


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024  # Linux reports KiB


def prefill_marks(loaded: Any, lengths: list[int], chunk: int) -> list[Mark]:
    """Prefill one prompt of max(lengths) tokens in `chunk`-token passes; a Mark at each length."""
    import mlx.core as mx

    from mlxgate.models.adapter import ModelAdapter

    adapter = ModelAdapter(loaded.model)
    vocab = loaded.tokenizer.vocab_size
    ids = mx.random.randint(100, vocab - 100, (1, max(lengths)), key=mx.random.key(0))
    warm = adapter.make_cache()  # first passes allocate and compile
    for start in range(0, 2 * chunk, chunk):
        adapter.prefill(ids[:, start : start + chunk], warm)
    del warm
    mx.clear_cache()
    mx.reset_peak_memory()

    cache = adapter.make_cache()
    marks: list[Mark] = []
    finished_at: list[tuple[int, float]] = [(0, 0.0)]  # (tokens, seconds) after each pass
    started = time.perf_counter()
    for start in range(0, max(lengths), chunk):
        adapter.prefill(ids[:, start : start + chunk], cache)
        done = min(start + chunk, max(lengths))
        finished_at.append((done, time.perf_counter() - started))
        if done in lengths:
            before = [(n, s) for n, s in finished_at if n <= done - MARGINAL_TOKENS]
            n0, s0 = before[-1] if before else (0, 0.0)
            elapsed = finished_at[-1][1]
            marks.append(
                Mark(
                    length=done,
                    seconds=elapsed,
                    marginal_tok_s=(done - n0) / (elapsed - s0),
                    kv_bytes=sum(c.nbytes for c in cache),
                    peak_mlx_bytes=mx.get_peak_memory(),
                    peak_rss_bytes=peak_rss_bytes(),
                    load_average=os.getloadavg()[0],
                )
            )
            print(
                f"{done} tokens: {done / elapsed:.1f} tok/s, last {done - n0}: "
                f"{marks[-1].marginal_tok_s:.1f} tok/s, KV {marks[-1].kv_bytes / 2**20:.0f} MiB",
                flush=True,
            )
    return marks


def filler_text() -> str:
    """Docstrings of stdlib modules and their public members, in a fixed order."""
    parts: list[str] = []
    for name in FILLER_MODULES:
        module = importlib.import_module(name)
        for member_name, member in [(name, module), *sorted(vars(module).items())]:
            if member_name.startswith("_") and member is not module:
                continue
            doc = inspect.getdoc(member) if callable(member) or member is module else None
            if doc and len(doc) > 200 and doc not in parts:
                parts.append(doc)
    return "\n\n".join(parts)


def recall_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """A chat turn of about `tokens` tokens: the fact, documentation, then the question."""
    filler = filler_text()
    low, high = 0, len(filler)
    while low < high:  # the longest filler prefix that keeps the turn within `tokens`
        middle = (low + high + 1) // 2
        if len(turn(tokenizer, filler[:middle])) <= tokens:
            low = middle
        else:
            high = middle - 1
    ids = turn(tokenizer, filler[:low])
    if len(ids) < tokens * 0.95:
        raise SystemExit(f"the filler text gives only {len(ids)} tokens, {tokens} asked")
    return ids


def turn(tokenizer: Any, filler: str) -> list[int]:
    content = f"{FACT}\n\n{filler}\n\n{QUESTION}"
    ids: list[int] = tokenizer.encode(tokenizer.render([{"role": "user", "content": content}]))
    return ids


@dataclass
class Reading:
    """One model's pass over a recall prompt."""

    nll: list[float]  # of each prompt token after the first, given the ones before it
    reply: str  # greedy, up to RECALL_TOKENS tokens
    seconds: float

    def perplexity(self, start: int, stop: int) -> float:
        """Of the prompt tokens at positions [start, stop)."""
        window = self.nll[max(start - 1, 0) : stop - 1]
        return math.exp(sum(window) / len(window))


def read(model: Any, tokenizer: Any, prompt: list[int], chunk: int) -> Reading:
    """Run `model` over `prompt` in `chunk`-token passes into a cache of the kinds it asks for,
    scoring each next prompt token, then reply greedily."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxgate.models.adapter import ModelAdapter

    started = time.perf_counter()
    adapter = ModelAdapter(model)
    cache = adapter.make_cache()
    ids = mx.array([prompt])
    nll: list[float] = []
    for start in range(0, len(prompt), chunk):
        stop = min(start + chunk, len(prompt))
        logits = model(ids[:, start:stop], cache=cache)
        if stop < len(prompt):
            losses = nn.losses.cross_entropy(logits, ids[:, start + 1 : stop + 1])
        else:  # the last position predicts the reply's first token
            losses = nn.losses.cross_entropy(logits[:, :-1], ids[:, start + 1 : stop])
        nll.extend(losses[0].tolist())  # type: ignore[arg-type]
    token = mx.argmax(logits[:, -1, :], axis=-1)
    out: list[int] = []
    while len(out) < RECALL_TOKENS:
        next_id: int = token.item()  # type: ignore[assignment]
        if next_id in tokenizer.eos_ids:
            break
        out.append(next_id)
        token = mx.argmax(adapter.decode(token, cache), axis=-1)
    return Reading(nll, tokenizer.decode(out), time.perf_counter() - started)


def unscaled_twin(loaded: Any) -> Any:
    """The same weights with the model's own rope (what serving 8,192 tokens would run)."""
    from mlx_lm.models import llama

    from mlxgate.models.cpu import install_kernels

    args = llama.ModelArgs.from_dict({**vars(loaded.model.args), "rope_scaling": None})
    twin = llama.Model(args)
    twin.update(loaded.model.parameters())
    install_kernels(twin)
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192,16384,32768")
    parser.add_argument("--recall", default="1000,12000", help="document lengths, tokens")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    lengths = sorted(int(n) for n in args.lengths.split(","))
    recall_lengths = [int(n) for n in args.recall.split(",") if n]

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate import blas
    from mlxgate.engine import EngineSettings
    from mlxgate.models import load

    load_average = os.getloadavg()
    chunk = EngineSettings().max_prefill_chunk
    if any(n % chunk for n in lengths):
        raise SystemExit(f"--lengths must be multiples of the prefill chunk ({chunk})")
    loaded = load(None)
    if max(lengths) > loaded.context_length:
        raise SystemExit(f"--lengths go past the served context ({loaded.context_length})")
    print(f"model {loaded.name}, context {loaded.describe_context()}", flush=True)
    marks = prefill_marks(loaded, lengths, chunk)

    readings: list[tuple[int, str, Reading]] = []
    twin = unscaled_twin(loaded)
    for tokens in recall_lengths:
        prompt = recall_prompt(loaded.tokenizer, tokens)
        for label, model in (("served", loaded.model), ("own rope", twin)):
            reading = read(model, loaded.tokenizer, prompt, chunk)
            readings.append((len(prompt), label, reading))
            print(f"{len(prompt)} tokens, {label}: {reading.reply!r}", flush=True)

    command = " ".join(["benches/studies/context_cost.py", *sys.argv[1:]])
    first = marks[0]
    lines = [
        f"# Context cost of the embedded model ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`{command}`: {loaded.name}, context {loaded.describe_context()}, float32, CPU, BLAS "
        f"{blas.blas_in_use()}, {os.cpu_count()} cores, load average (1 min) "
        f"{load_average[0]:.2f} before the run (this process then keeps about 2 busy: more "
        "in the load column means other work shared the cores). One prompt prefilled through "
        "the engine's model adapter in "
        f"{chunk}-token passes; each row is the prompt at that length.",
        "",
        f"| context | prefill tok/s | vs {first.length:,} | last {MARGINAL_TOKENS:,} tokens: "
        "tok/s | time | KV cache | KV bytes/token | peak memory (MLX) | peak RSS | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mark in marks:
        rate = mark.length / mark.seconds
        lines.append(
            f"| {mark.length:,} | {rate:.1f} | {rate / (first.length / first.seconds):.2f}x | "
            f"{mark.marginal_tok_s:.1f} | {mark.seconds:.0f} s | "
            f"{mark.kv_bytes / 2**20:,.0f} MiB | {mark.kv_bytes / mark.length:,.0f} | "
            f"{mark.peak_mlx_bytes / 2**20:,.0f} MiB | {mark.peak_rss_bytes / 2**20:,.0f} MiB | "
            f"{mark.load_average:.2f} |"
        )
    spans = [(0, 2048), (2048, 8192), (8192, 16384), (16384, 32768)]
    longest = max((tokens for tokens, _, _ in readings), default=0)
    spans = [span for span in spans if span[0] < longest]
    lines += [
        "",
        f"Recall: the fact ({FACT!r}) at the start of a document of stdlib docstrings, then "
        f"{QUESTION!r}, one user turn; greedy, up to {RECALL_TOKENS} tokens. `served`: the "
        "model as served (YaRN x4); `own rope`: the same weights with their unscaled rope (as "
        "`--context-length 8192` serves them). Perplexity: of the prompt's own tokens at those "
        "positions, each given the ones before it.",
        "",
        "| prompt tokens | model | found the code | reply | "
        + " | ".join(f"perplexity {a:,}-{b:,}" for a, b in spans)
        + " | time |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in spans) + " | --- |",
    ]
    for tokens, label, reading in readings:
        shown = " ".join(reading.reply.split()).replace("|", "\\|")
        found = "yes" if CODE in reading.reply else "no"
        perplexities = [
            f"{reading.perplexity(a, min(b, tokens)):.2f}" if a < tokens else "" for a, b in spans
        ]
        lines.append(
            f"| {tokens:,} | {label} | {found} | {shown} | {' | '.join(perplexities)} | "
            f"{reading.seconds:.0f} s |"
        )
    publish(lines, args.out, "context-cost")


if __name__ == "__main__":
    main()
