"""What a verify pass costs: a forward pass over each row's input token and its guesses, against
a plain decode step of the same rows, by rows decoding and positions per row.

    PYTHONPATH=benches .venv/bin/python benches/studies/verify_cost.py \
        [--rows 1,2,4,8,16] [--widths 1,3,5,9,13] [--model FILE]

In-process, the embedded model (or `--model`, as `mlxgate serve --model` takes it) through
mlxgate's adapter and the engine's batch caches, of each layer's kind. The passes of one round
run back to back for every width (interleaved, so that the machine's drift touches all alike),
each rewound afterwards to its input token, as the engine rewinds a pass whose guesses were all
wrong (the context grows by a token a pass); a sliding window is put in temporal order before
each, as the engine does. The report gives the median ratio to width 1 over the rounds. A row
that keeps `g` guesses per pass on average gets `g + 1` tokens for one pass's time, so
speculation pays where `g + 1` exceeds the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from report import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--widths", default="1,3,5,9,13")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="a model to load instead of the embedded")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    import numpy as np
    from mlxgate.engine import cache_kinds
    from mlxgate.models import load
    from mlxgate.models.adapter import ModelAdapter

    loaded = load(args.model)
    adapter = ModelAdapter(loaded.model)
    widths = [int(w) for w in args.widths.split(",")]
    rng = np.random.default_rng(0)
    lines = [
        "# Verify pass cost",
        "",
        f"Command: `.venv/bin/python benches/studies/verify_cost.py --rows {args.rows} "
        f"--widths {args.widths} --context {args.context} --rounds {args.rounds}"
        + (f" --model {args.model}" if args.model else "")
        + "`  ",
        f"Model: {loaded.name}, {args.context} tokens of context per row; median over "
        f"{args.rounds} interleaved rounds.",
        "",
        "| rows | " + " | ".join(f"width {w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for rows in (int(r) for r in args.rows.split(",")):
        singles = adapter.make_cache()
        prompt = mx.array(rng.integers(0, 40000, size=(1, args.context)).astype(np.uint32))
        for start in range(0, args.context, 256):
            adapter.prefill(prompt[:, start : start + 256], singles)
        caches = [cache_kinds.merge([cache] * rows) for cache in singles]
        times: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(args.rounds + 1):  # the first round warms up
            for width in widths:
                inputs = mx.array(rng.integers(0, 40000, size=(rows, width)).astype(np.uint32))
                started = time.perf_counter()
                for cache in caches:
                    cache_kinds.in_temporal_order(cache)
                mx.eval(adapter.verify(inputs, caches))
                times[width].append(time.perf_counter() - started)
                for cache in caches:
                    cache_kinds.rewind(cache, np.ones(rows, dtype=np.int64), width)
        base = statistics.median(times[widths[0]][1:])
        cells = []
        for width in widths:
            median = statistics.median(times[width][1:])
            cells.append(f"{median * 1000:.0f} ms ({median / base:.2f}x)")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    publish(lines, args.out, "verify-cost")


if __name__ == "__main__":
    main()
