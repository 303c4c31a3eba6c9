"""What taking back a verify pass costs in a gated delta layer (Qwen3-Next, Qwen3.5): mlx-lm's
`gated_delta_update` over the pass's positions, run again from the state before it
(models/recurrent_guesses.py), against one position (a plain decode step's recurrence).

    PYTHONPATH=benches .venv/bin/python benches/studies/gated_delta_cost.py \
        [--rows 1,4] [--widths 1,5,9] [--heads 16,32] [--head-dim 128]

The layer's shape defaults to Qwen3.5-35B-A3B's (16 key heads, 32 value heads, 128 features;
30 such layers), its state random. On CPU mlx-lm computes the recurrence with MLX ops, one
position after the other; a pass computes it once, and a pass whose rows rejected guesses once
more. Medians over `--rounds` after two warm-up calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from report import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--widths", default="1,5,9")
    parser.add_argument("--heads", default="16,32", help="key heads, value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    from mlx_lm.models import gated_delta

    key_heads, value_heads = (int(h) for h in args.heads.split(","))
    dim = args.head_dim
    widths = [int(w) for w in args.widths.split(",")]
    lines = [
        "# A gated delta layer's recurrence, by rows and positions",
        "",
        f"Command: `PYTHONPATH=benches .venv/bin/python benches/studies/gated_delta_cost.py "
        f"--rows {args.rows} --widths {args.widths} --heads {args.heads} --head-dim {dim} "
        f"--rounds {args.rounds}`  ",
        f"{key_heads} key heads, {value_heads} value heads of {dim}; a layer, medians over "
        f"{args.rounds} calls.",
        "",
        "| rows | " + " | ".join(f"{w} positions" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        for width in widths:
            q, k = (mx.random.normal((rows, width, key_heads, dim)) for _ in range(2))
            v = mx.random.normal((rows, width, value_heads, dim))
            a, b = (mx.random.normal((rows, width, value_heads)) for _ in range(2))
            a_log, dt_bias = (mx.random.normal((value_heads,)) for _ in range(2))
            state = mx.random.normal((rows, value_heads, dim, dim))
            # As a restore masks it: each row's positions after its last kept one.
            kept = mx.arange(width)[None] < mx.array([max(1, width - 3)] * rows)[:, None]
            mask = kept if width > 1 else None
            mx.eval(q, k, v, a, b, a_log, dt_bias, state, kept)
            times = []
            for _ in range(args.rounds + 2):
                started = time.perf_counter()
                _, after = gated_delta.gated_delta_update(
                    q, k, v, a, b, a_log, dt_bias, state, mask
                )
                mx.eval(after)
                times.append(time.perf_counter() - started)
            cells.append(f"{statistics.median(times[2:]) * 1000:.2f} ms")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    publish(lines, args.out, "gated-delta-cost")


if __name__ == "__main__":
    main()
