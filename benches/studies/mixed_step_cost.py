"""What one forward pass for a step's decode rows and its prefill chunk together would save: the
two passes a step makes today (R decoding rows, then a K-token chunk of a prompt) against one
pass over R + K tokens, by rows and chunk size.

    PYTHONPATH=benches .venv/bin/python benches/studies/mixed_step_cost.py \
        [--rows 1,8,32] [--chunks 32,128,256] [--context 512] [--rounds 7]

In-process, the embedded model through mlxgate's adapter and KV caches. Today's step: a decode
pass over R rows of `--context` tokens each (logits for every row), then a prefill pass of K
prompt tokens after `--context` tokens of that prompt. The fused pass is its upper bound: one
sequence of R + K tokens through the layers after `--context` tokens (every weight read once,
the matmuls R + K rows tall), then the head over R rows. Its attention is one causal sequence,
not R rows over their own caches, so it prices the weights and matmuls, not a ragged
attention. Each round times every shape back to back (interleaved: the machine's speed
drifts), the caches rewound after each pass; the report gives medians over the rounds after a
warm-up round, and the fused pass's time over today's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from report import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--chunks", default="32,128,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlxgate.models import load
    from mlxgate.models.adapter import ModelAdapter

    loaded = load(None)
    adapter = ModelAdapter(loaded.model)
    model = loaded.model
    head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
    layers = len(adapter.make_cache())
    rng = np.random.default_rng(0)

    def tokens(rows: int, width: int) -> mx.array:
        return mx.array(rng.integers(0, 40000, size=(rows, width)).astype(np.uint32))

    def filled(cache_rows: int) -> list:
        caches = (
            [BatchKVCache([0] * cache_rows) for _ in range(layers)]
            if cache_rows > 1
            else [KVCache() for _ in range(layers)]
        )
        prompt = tokens(cache_rows, args.context)
        for start in range(0, args.context, 256):
            adapter.prefill(prompt[:, start : start + 256], caches)
        return caches

    rows_list = [int(r) for r in args.rows.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    prompt_caches = filled(1)
    fused_caches = filled(1)
    decode_caches = {rows: filled(rows) for rows in rows_list}
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for rows in rows_list:
            for chunk in chunks:
                started = time.perf_counter()
                mx.eval(adapter.decode(tokens(rows, 1)[:, 0], decode_caches[rows]))
                adapter.prefill(tokens(1, chunk), prompt_caches)
                today = time.perf_counter() - started
                started = time.perf_counter()
                hidden = adapter.backbone(tokens(1, rows + chunk), cache=fused_caches)
                mx.eval(head(hidden[:, :rows]))
                fused = time.perf_counter() - started
                for cache in decode_caches[rows]:
                    cache.trim(1)
                for cache in prompt_caches:
                    cache.trim(chunk)
                for cache in fused_caches:
                    cache.trim(rows + chunk)
                times.setdefault(("today", rows, chunk), []).append(today)
                times.setdefault(("fused", rows, chunk), []).append(fused)
    lines = [
        "# A step's decode and prefill in one pass: what it would save",
        "",
        f"Command: `PYTHONPATH=benches .venv/bin/python benches/studies/mixed_step_cost.py "
        f"--rows {args.rows} --chunks {args.chunks} --context {args.context} "
        f"--rounds {args.rounds}`  ",
        f"Model: {loaded.name}; {args.context} tokens of context per row and before the chunk; "
        f"medians over {args.rounds} interleaved rounds.",
        "",
        "| decoding rows | chunk | today: decode + prefill | one pass (upper bound) | ratio |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for rows in rows_list:
        for chunk in chunks:
            today = statistics.median(times[("today", rows, chunk)][1:])
            fused = statistics.median(times[("fused", rows, chunk)][1:])
            lines.append(
                f"| {rows} | {chunk} | {today * 1000:.1f} ms | {fused * 1000:.1f} ms "
                f"| {fused / today:.2f}x |"
            )
            print(lines[-1], flush=True)
    publish(lines, args.out, "mixed-step-cost")


if __name__ == "__main__":
    main()
