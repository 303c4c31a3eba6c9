"""What each weight precision costs per decode step on this CPU, against float32, in one run.

    PYTHONPATH=benches .venv/bin/python benches/studies/precision.py \
        [--rounds 3] [--steps 12] [--rows 1,8]

The embedded model (SmolLM2-135M, llama) is loaded once and copied into each precision mlx-lm
serves: float32, bfloat16, float16, affine 8-bit and 4-bit (group 64, as `mlx_lm.convert -q`),
mxfp4 (gpt-oss's). Each copy decodes `steps` tokens after a 32-token prompt, at each batch
size; the copies take turns round after round (the machine's speed drifts), and the report
gives each one's median step time and its ratio to float32's from the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from report import publish

PRECISIONS = ["float32", "bfloat16", "float16", "8-bit", "4-bit", "mxfp4"]


def variant(name: str) -> Any:
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model

    from mlxgate.models import load

    model = load(None, weights="float32", cpu_kernels=False).model  # the float32 baseline
    if name in ("bfloat16", "float16"):
        dtype = getattr(mx, name)
        model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    elif name in ("8-bit", "4-bit"):
        quantize_model(model, {}, group_size=64, bits=int(name[0]), mode="affine")
    elif name == "mxfp4":
        quantize_model(model, {}, group_size=32, bits=4, mode="mxfp4")
    mx.eval(model.parameters())
    return model


def step_seconds(model: Any, rows: int, steps: int) -> float:
    """Median seconds of one decode step of `rows` sequences after a 32-token prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array([[(13 * i) % 4000 + 10 for i in range(32)]] * rows)
    token = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
    mx.eval(token)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate import blas
    from mlxgate.models import precision

    batch_sizes = [int(r) for r in args.rows.split(",")]
    models = {name: variant(name) for name in PRECISIONS}
    for model in models.values():  # warm-up: kernels compile on first use
        step_seconds(model, 1, 2)
    samples: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for rows in batch_sizes:
            for name, model in models.items():
                seconds = step_seconds(model, rows, args.steps)
                samples.setdefault((name, rows), []).append(seconds)
                print(
                    f"round {round_ + 1}, {rows} row(s), {name}: {seconds * 1e3:.1f} ms", flush=True
                )

    lines = [
        f"# Decode step cost per weight precision ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/studies/precision.py --rounds {args.rounds} --steps {args.steps} "
        f"--rows {args.rows}`"
        f": SmolLM2-135M, 32-token prompt, CPU, BLAS {blas.blas_in_use()}. Median step time "
        "over the rounds (each the median of its steps); ratio to float32 from the same rounds.",
        "",
        "| precision | stored as | "
        + " | ".join(f"{r} row(s): ms, x f32" for r in batch_sizes)
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in batch_sizes) + " |",
    ]
    for name, model in models.items():
        cells = []
        for rows in batch_sizes:
            ms = statistics.median(samples[(name, rows)]) * 1e3
            base = statistics.median(samples[("float32", rows)]) * 1e3
            cells.append(f"{ms:.1f} ms, {ms / base:.2f}x")
        lines.append(f"| {name} | {precision(model)} | " + " | ".join(cells) + " |")
    publish(lines, args.out, "precision")


if __name__ == "__main__":
    main()
