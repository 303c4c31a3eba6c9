"""In-process speed of the embedded model (prefill, decode steps) and the serving bound it implies.

    .venv/bin/python benches/bound.py [--json]

One process, the model loaded once, OpenBLAS preloaded by `import mlxgate`. No HTTP, no
scheduling: what is measured here is what any server on this machine has to pay, so
`c32_bound` is an upper limit on the aggregate output tok/s of the C=32 serving scenario.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

PREFILL_CHUNKS = (64, 128, 256, 512)
BATCH_PREFILL = (8, 70)  # prompts x tokens
DECODE_BATCHES = (1, 8, 32)
CONTEXT_TOKENS = 70
# A batch-32 step is also measured deeper into the sequences: attention grows with context, and
# the C=32 scenario's rows decode from ~70 to ~200 tokens of context.
LATE_CONTEXT_TOKENS = 198
DECODE_STEPS = 8


def _timed(fn: Any, repeats: int) -> float:
    """Best of `repeats` wall times of fn() in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(repeats: int = 3) -> dict[str, Any]:
    import mlxgate  # noqa: F401, I001  (first: it preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlxgate import blas
    from mlxgate.models import load

    loaded = load(None)
    model = loaded.model
    layers = len(model.layers)
    vocab = loaded.tokenizer.vocab_size
    # Ordinary token ids, away from the special ones at the start of the vocabulary.
    rng = mx.random.key(0)

    def tokens(batch: int, length: int) -> mx.array:
        return mx.random.randint(100, vocab - 100, (batch, length), key=rng).astype(mx.uint32)

    def prefill(batch: int, length: int) -> float:
        ids = tokens(batch, length)

        def run() -> None:
            cache = [KVCache() for _ in range(layers)]
            mx.eval(model(ids, cache=cache)[:, -1, :])

        run()  # warm-up: first use of a shape allocates
        return batch * length / _timed(run, repeats)

    prefill_tok_s = {f"prefill_{n}": prefill(1, n) for n in PREFILL_CHUNKS}
    batch, length = BATCH_PREFILL
    prefill_tok_s[f"prefill_{batch}x{length}"] = prefill(batch, length)

    def decode_step(batch: int, context: int = CONTEXT_TOKENS) -> float:
        if batch == 1:
            cache: list[Any] = [KVCache() for _ in range(layers)]
        else:
            cache = [BatchKVCache([0] * batch) for _ in range(layers)]
        logits = model(tokens(batch, context), cache=cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        times = []
        for _ in range(DECODE_STEPS + 1):
            started = time.perf_counter()
            token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.eval(token)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    decode_s = {f"decode_step_{b}": decode_step(b) for b in DECODE_BATCHES}
    decode_s[f"decode_step_32_at_{LATE_CONTEXT_TOKENS}"] = decode_step(32, LATE_CONTEXT_TOKENS)
    return {
        "blas": blas.blas_in_use(),
        "prefill_tok_s": prefill_tok_s,
        "best_prefill_tok_s": max(prefill_tok_s.values()),
        "decode_step_s": decode_s,
    }


def decode_step_32(measured: dict[str, Any], context: float) -> float:
    """A batch-32 decode step at `context` tokens, linear between the two measured contexts."""
    steps = measured["decode_step_s"]
    early = steps["decode_step_32"]
    late = steps.get(f"decode_step_32_at_{LATE_CONTEXT_TOKENS}", early)
    per_token = (late - early) / (LATE_CONTEXT_TOKENS - CONTEXT_TOKENS)
    return float(early + per_token * (context - CONTEXT_TOKENS))


def c32_bound(
    measured: dict[str, Any],
    *,
    requests: int = 64,
    concurrency: int = 32,
    prompt_tokens: float = 70,
    output_tokens: int = 128,
) -> dict[str, float]:
    """Best possible aggregate output tok/s for the C=32 scenario on this machine.

    All prompts prefilled at the best measured prefill rate, then every wave of `concurrency`
    sequences decoded, each step priced at its context: steps grow linearly with it, so a wave
    costs `output_tokens` steps at the wave's mean context.
    """
    waves = math.ceil(requests / concurrency)
    prefill_s = requests * prompt_tokens / measured["best_prefill_tok_s"]
    mean_context = prompt_tokens + (output_tokens - 1) / 2
    step_s = decode_step_32(measured, mean_context)
    decode_s = waves * output_tokens * step_s
    total_output = requests * output_tokens
    # As bound.py priced it until 2026-11-22: every step at the prompt's context, which no
    # server can reach (kept for comparison with older records).
    at_prompt_s = waves * output_tokens * decode_step_32(measured, prompt_tokens)
    return {
        "bound_tok_s": total_output / (prefill_s + decode_s),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prompt_tokens": prompt_tokens,
        "mean_context": mean_context,
        "step_s": step_s,
        "bound_at_prompt_context_tok_s": total_output / (prefill_s + at_prompt_s),
    }


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best of each figure over several `measure()` runs: the machine's speed drifts, and
    the fastest moment gives the strictest bound."""
    prefill = {k: max(r["prefill_tok_s"][k] for r in runs) for k in runs[0]["prefill_tok_s"]}
    decode = {k: min(r["decode_step_s"][k] for r in runs) for k in runs[0]["decode_step_s"]}
    return {
        "blas": runs[0]["blas"],
        "prefill_tok_s": prefill,
        "best_prefill_tok_s": max(prefill.values()),
        "decode_step_s": decode,
        "runs": len(runs),
    }


def format_table(measured: dict[str, Any], bound: dict[str, float]) -> str:
    lines = [f"BLAS: {measured['blas']}", ""]
    if measured.get("runs", 1) > 1:
        lines += [
            f"Measured {measured['runs']} times (just before and just after the C=32 runs); "
            "each figure is the best of them, the strictest bound.",
            "",
        ]
    lines += ["| measurement | figure |", "| --- | --- |"]
    for name, tok_s in measured["prefill_tok_s"].items():
        lines.append(f"| {name.replace('_', ' ')} tokens | {tok_s:.0f} tok/s |")
    for name, seconds in measured["decode_step_s"].items():
        batch, _, context = name.removeprefix("decode_step_").partition("_at_")
        lines.append(
            f"| decode step, batch {batch}, {context or CONTEXT_TOKENS} tokens of context "
            f"| {seconds * 1000:.0f} ms ({int(batch) / seconds:.0f} tok/s aggregate) |"
        )
    lines.append(
        f"| C=32 bound (64 requests x {bound['prompt_tokens']:.0f} prompt + 128 output tokens; "
        f"decode steps at {bound['mean_context']:.0f} tokens of context on average, "
        f"{bound['step_s'] * 1000:.0f} ms) | {bound['bound_tok_s']:.0f} tok/s "
        f"(prefill {bound['prefill_s']:.1f} s + decode {bound['decode_s']:.1f} s) |"
    )
    lines.append(
        f"| the same with every step priced at the prompt's context (the bound before "
        f"2026-11-22) | {bound['bound_at_prompt_context_tok_s']:.0f} tok/s |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=float, default=70, help="C=32 prompt length")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    measured = measure(args.repeats)
    bound = c32_bound(measured, prompt_tokens=args.prompt_tokens)
    if args.json:
        print(json.dumps({**measured, "c32": bound}))
    else:
        print(format_table(measured, bound))


if __name__ == "__main__":
    main()
