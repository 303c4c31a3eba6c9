"""What `--int8-activations` costs in tokens and buys in speed, on a real model: greedy decoding of
a batch of real prompts with the exact kernels and with the int8 path, in one run.

    PYTHONPATH=benches .venv/bin/python benches/int8_agreement.py [--model FILE.gguf] [--plain]
        [--rows 8 32] [--tokens 128]

Per batch size (rows: that many streams decoding together, each a different prompt cut to one
length, so the prefill is one pass of rows x length):
- top-1 agreement under teacher forcing: both paths fed the exact path's tokens, the share of
  steps whose greedy token is the same (the per-step error, free of where a divergence leads);
- free-running: each path's own greedy continuation, the tokens before the first difference
  (median over the rows) and the rows that never differ;
- the decode step and the prefill pass, exact and int8, interleaved (medians): the speed ratio.
The embedded model unless --model names a GGUF (e.g. PyPI's Gemma 3 270M Q4_K_M, a base model:
--plain gives it each question as "Question: ...\nAnswer:", not in a chat template).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from report import log, publish

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)

QUESTIONS = [
    "Explain how a hash map handles collisions, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Answer in a table.",
    "Summarize the causes of the French Revolution in five bullet points.",
    "Write a Rust function that reverses the words of a sentence, and test it.",
    "How does photosynthesis work? Explain it to a ten-year-old.",
    "Give me a three-day itinerary for Lisbon on a small budget.",
    "Prove that the square root of two is irrational.",
    "What is the difference between a process and a thread?",
    "Translate 'the weather is lovely today' into French, Spanish and German.",
    "List five ways to make a slow SQL query faster, with a sentence on each.",
    "Describe the water cycle, step by step.",
    "Write a haiku about debugging at midnight.",
    "Why is the sky blue? Give the physics in plain words.",
    "Compare merge sort and quicksort: time, memory, stability.",
    "Draft a polite email asking a colleague to review a pull request.",
]


def prompts(tokenizer: Any, rows: int, plain: bool = False) -> list[list[int]]:
    """`rows` prompts (the questions in turn, numbered past the first sixteen), in the chat
    template or as plain text (a base model's), each cut to the shortest one's length (from the
    second token on) so that a batch prefills in one pass."""
    encoded = []
    for i in range(rows):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"({i // len(QUESTIONS) + 1}) {question}"
        if plain:
            text = f"{tokenizer.bos_token or ''}Question: {question}\nAnswer:"
        else:
            text = tokenizer.render([{"role": "user", "content": question}])
        encoded.append(tokenizer.encode(text))
    length = min(len(p) for p in encoded)
    return [p[:1] + p[len(p) - length + 1 :] for p in encoded]  # the first (BOS) kept


class Decoder:
    """One model decoding a batch greedily, its KV caches kept between steps."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def prefill(self, batch: list[list[int]]) -> Any:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(batch), cache=self.cache)[:, -1]
        mx.eval(logits)
        return logits

    def step(self, tokens: Any) -> Any:
        import mlx.core as mx

        logits = self.model(tokens[:, None], cache=self.cache)[:, -1]
        mx.eval(logits)
        return logits


def agreement(exact: Any, fast: Any, batch: list[list[int]], steps: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    # Teacher forcing: both fed the exact path's tokens.
    a, b = Decoder(exact), Decoder(fast)
    la, lb = a.prefill(batch), b.prefill(batch)
    same = total = 0
    for _ in range(steps):
        ta, tb = mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)
        same += int(np.sum(np.asarray(ta) == np.asarray(tb)))
        total += ta.size
        la, lb = a.step(ta), b.step(ta)
    # Free-running: each its own greedy tokens.
    runs = []
    for decoder in (Decoder(exact), Decoder(fast)):
        logits = decoder.prefill(batch)
        out = []
        for _ in range(steps):
            tokens = mx.argmax(logits, axis=-1)
            out.append(tokens.tolist())
            logits = decoder.step(tokens)
        runs.append([list(column) for column in zip(*out, strict=True)])
    first = []
    for x, y in zip(*runs, strict=True):
        diverged = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
        first.append(diverged[0] if diverged else steps)
    return {
        "teacher": same / total,
        "median_first": statistics.median(first),
        "never": sum(1 for f in first if f == steps),
    }


def speeds(exact: Any, fast: Any, batch: list[list[int]], rounds: int) -> dict[str, float]:
    """Median decode step and prefill pass (ms) of each, interleaved round by round."""
    import random

    import mlx.core as mx

    times: dict[str, list[float]] = {
        k: [] for k in ("exact step", "int8 step", "exact prefill", "int8 prefill")
    }
    decoders = {"exact": Decoder(exact), "int8": Decoder(fast)}
    for _ in range(rounds):
        order = list(decoders)
        random.shuffle(order)
        for name in order:
            decoder = decoders[name]
            start = time.perf_counter()
            logits = decoder.prefill(batch)
            times[f"{name} prefill"].append((time.perf_counter() - start) * 1e3)
            tokens = mx.argmax(logits, axis=-1)
            decoder.step(tokens)
            start = time.perf_counter()
            for _ in range(4):
                decoder.step(tokens)
            times[f"{name} step"].append((time.perf_counter() - start) / 4 * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--plain", action="store_true", help="the prompts as plain text (a base model's)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    import mlxgate_kernels

    from mlxgate import models
    from mlxgate.bench.machine import cpu_described

    exact = models.load(args.model)
    fast = models.load(args.model, int8_activations=True)
    name = Path(args.model).name if args.model else "the embedded model (SmolLM2-135M Q4_1)"
    vnni = mlxgate_kernels.vnni_supported() and mlxgate_kernels.using_avx512()
    isa = "AVX-512 VNNI" if vnni else "AVX2"
    lines = [
        f"# `--int8-activations` on {name}: token agreement and speed",
        "",
        f"Machine: {cpu_described()}; the int8 path's multiply: {isa}.",
        f"Served as: {fast.kernels}.",
        f"Command: `PYTHONPATH=benches .venv/bin/python benches/int8_agreement.py"
        f"{' --model ' + args.model if args.model else ''} --rows {' '.join(map(str, args.rows))}"
        f" --tokens {args.tokens}{' --plain' if args.plain else ''}`",
        "",
        "| rows | prompt tokens | teacher-forced top-1 agreement | free-running: median tokens "
        "before the first difference | rows never differing | decode step exact / int8 (ms) "
        "| prefill pass exact / int8 (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rows in args.rows:
        batch = prompts(exact.tokenizer, rows, args.plain)
        log(f"{rows} rows of {len(batch[0])} tokens: agreement over {args.tokens} steps")
        agreed = agreement(exact.model, fast.model, batch, args.tokens)
        log(f"{rows} rows: speed, {args.rounds} rounds")
        speed = speeds(exact.model, fast.model, batch, args.rounds)
        step = speed["exact step"] / speed["int8 step"]
        prefill = speed["exact prefill"] / speed["int8 prefill"]
        lines.append(
            f"| {rows} | {len(batch[0])} | {agreed['teacher']:.1%} | {agreed['median_first']:g} "
            f"of {args.tokens} | {agreed['never']} of {rows} | {speed['exact step']:.1f} / "
            f"{speed['int8 step']:.1f} ({step:.2f}x) | {speed['exact prefill']:.0f} / "
            f"{speed['int8 prefill']:.0f} ({prefill:.2f}x) |"
        )
    publish(lines, args.out, "int8-agreement")


if __name__ == "__main__":
    main()
