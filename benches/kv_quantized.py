"""The quantized KV cache (`--kv-bits`) against the float one, on the embedded model: how many
greedy tokens agree with the float cache's, the KV bytes a token takes, and the decode step time.

    .venv/bin/python benches/kv_quantized.py [--tokens 64]

Each prompt is prefilled and decoded alone through the engine's adapter and its one-row batch
caches (as the engine decodes a lone sequence), then all of them in one batch. Agreement is per
prompt: positions where the token equals the float cache's, and the tokens before the first
difference (after it the texts go their own ways, so later positions say little).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about snow.",
    "Explain in two sentences why the sky is blue.",
    "List five animals that live in the ocean.",
]
# A long prompt: decode steps attend over ~1,600 keys, where the cache's kind shows in the time.
LONG = "Summarize the following notes.\n" + (
    "The meeting covered the budget, the hiring plan and the office move. " * 110
)
BITS = [0, 8, 4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    import mlx.core as mx

    from mlxgate.engine import cache_kinds
    from mlxgate.models import load
    from mlxgate.models.adapter import ModelAdapter

    loaded = load(None, context_length=8192)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.render([{"role": "user", "content": q}])) for q in [*QUESTIONS, LONG]]

    def generate(adapter: ModelAdapter, prompt: list[int]) -> tuple[list[int], list[float], float]:
        """Greedy tokens, each decode step's seconds, and the KV bytes per prompt token."""
        caches = adapter.make_cache()
        adapter.prefill(mx.array([prompt[:-1]], dtype=mx.uint32), caches)
        kept = [cache_kinds.snapshot(c, owned=True) for c in caches]
        mx.eval([cache_kinds.arrays(c) for c in kept])
        per_token = sum(cache_kinds.nbytes(c) for c in kept) / (len(prompt) - 1)
        rows = [cache_kinds.batch_of_one(c) for c in caches]
        token, tokens, steps = prompt[-1], [], []
        for _ in range(args.tokens):
            started = time.perf_counter()
            logits = adapter.decode(mx.array([token], dtype=mx.uint32), rows)
            token = int(mx.argmax(logits[0]))
            steps.append(time.perf_counter() - started)
            tokens.append(token)
        return tokens, steps, per_token

    def batched_step_s(adapter: ModelAdapter) -> float:
        """The median decode step of every prompt in one batch (left-padded to the longest)."""
        singles = []
        for prompt in prompts:
            caches = adapter.make_cache()
            adapter.prefill(mx.array([prompt[:-1]], dtype=mx.uint32), caches)
            singles.append(caches)
        rows: list[Any] = [cache_kinds.merge(list(layer)) for layer in zip(*singles, strict=True)]
        inputs = mx.array([p[-1] for p in prompts], dtype=mx.uint32)
        steps = []
        for _ in range(24):
            started = time.perf_counter()
            inputs = mx.argmax(adapter.decode(inputs, rows), axis=-1).astype(mx.uint32)
            mx.eval(inputs)
            steps.append(time.perf_counter() - started)
        return sorted(steps[2:])[len(steps[2:]) // 2]

    results: dict[int, dict[str, Any]] = {}
    for bits in BITS:
        adapter = ModelAdapter(loaded.model, bits, 64)
        runs = [generate(adapter, p) for p in prompts]
        results[bits] = {
            "tokens": [r[0] for r in runs],
            "short_s": median([s for r in runs[:-1] for s in r[1][1:]]),
            "long_s": median(runs[-1][1][1:]),
            "bytes": runs[0][2],
            "batch_s": batched_step_s(adapter),
        }

    float_run = results[0]
    print(f"{loaded.name}, {args.tokens} greedy tokens per prompt, {len(prompts)} prompts")
    print(f"(prompt tokens: {', '.join(str(len(p)) for p in prompts)})\n")
    print(
        "| KV cache | tokens equal to float's | same tokens up to the first difference, per "
        "prompt | KV bytes a token | decode step, short prompts | decode step, long prompt "
        "| decode step, all in one batch |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for bits, run in results.items():
        same = [
            sum(a == b for a, b in zip(ours, theirs, strict=True))
            for ours, theirs in zip(run["tokens"], float_run["tokens"], strict=True)
        ]
        prefix = [
            common_prefix(ours, theirs)
            for ours, theirs in zip(run["tokens"], float_run["tokens"], strict=True)
        ]
        name = f"{bits}-bit" if bits else "float"
        print(
            f"| {name} | {sum(same) / (len(same) * args.tokens):.0%} "
            f"| {', '.join(map(str, prefix))} "
            f"| {run['bytes'] / 1024:.1f} KiB ({run['bytes'] / float_run['bytes']:.2f}x) "
            f"| {run['short_s'] * 1e3:.1f} ms ({run['short_s'] / float_run['short_s']:.2f}x) "
            f"| {run['long_s'] * 1e3:.1f} ms ({run['long_s'] / float_run['long_s']:.2f}x) "
            f"| {run['batch_s'] * 1e3:.1f} ms ({run['batch_s'] / float_run['batch_s']:.2f}x) |"
        )


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return len(a)


if __name__ == "__main__":
    main()
