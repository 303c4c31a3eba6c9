"""A vision-language model's text decode on this CPU, with mlxgate's kernels on its language model
and without (MLX's own ops), A/B interleaved step by step in one process.

    PYTHONPATH=tests .venv/bin/python benches/vision_decode.py \
        [--families gemma3 qwen2_5_vl] [--rows 1,8] [--rounds 8]

No real vision-language weights can be had offline: each family is mlx-vlm's own class with
random weights (tests/support/tiny_vlms.py), its language model at SmolLM2-135M's shape (as
benches/vision.py serves it) and quantized to 4 bits in groups of 64, as the mlx-community
checkpoints people run are. Each row's 74-token prompt is prefilled alone, then the rows are
batched as the engine batches them; a decode step's time is the median over the rounds (each
round an untimed step per variant, then two timed). The vision tower is not in a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from report import publish
from vision import SMALL_TEXT, write_model

PROMPT_TOKENS = 74


def language_model(directory: Path, kernels: bool) -> Any:
    """The model's language model, quantized as a 4-bit checkpoint is, with or without the
    kernels (models.load's order: quantized modules first, then the kernels on them)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxgate.models import vision
    from mlxgate.models.cpu import install_kernels

    model = vision.load(directory, None)[0]
    nn.quantize(model.language_model, group_size=64, bits=4)
    if kernels:
        install_kernels(model.language_model)
    mx.eval(model.parameters())
    return model.language_model


def batched_cache(model: Any, rows: int) -> Any:
    import mlx.core as mx
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for _ in range(rows):
        cache = model.make_cache() if hasattr(model, "make_cache") else make_prompt_cache(model)
        model(mx.random.randint(10, 200, (1, PROMPT_TOKENS)), cache=cache)
        mx.eval([layer.state for layer in cache])
        caches.append(cache)
    return _merge_caches(caches) if rows > 1 else caches[0]


def step_times(family: str, rows_list: list[int], rounds: int) -> dict[int, dict[str, float]]:
    import mlx.core as mx

    text = dict(SMALL_TEXT)
    if not family.startswith("qwen"):
        text.pop("rope_scaling")  # M-RoPE is Qwen's
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_model(family, Path(tmp) / family, text=text)
        models = {name: language_model(directory, name == "kernels") for name in ("mlx", "kernels")}
    medians: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        caches = {name: batched_cache(model, rows) for name, model in models.items()}
        tokens = mx.random.randint(10, 200, (rows, 1))
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                mx.eval(model(tokens, cache=caches[name]).logits)
                for _ in range(2):
                    started = time.perf_counter()
                    mx.eval(model(tokens, cache=caches[name]).logits)
                    times[name].append(time.perf_counter() - started)
        medians[rows] = {name: statistics.median(t) for name, t in times.items()}
        print(f"{family}, {rows} row(s): {medians[rows]}", flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["gemma3", "qwen2_5_vl"])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate.models.cpu import kernels

    rows_list = [int(r) for r in args.rows.split(",")]
    lines = [
        f"# A vision-language model's text decode, with and without the kernels "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/vision_decode.py --rows {args.rows} --rounds {args.rounds}`: mlx-vlm's classes "
        "with random weights, the language model at SmolLM2-135M's shape, 4 bits in groups of "
        f"64. Kernels: {kernels.describe()}; the vision tower stays on MLX's ops either way.",
        "",
        "| family | rows | MLX's ops | kernels | speed-up |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for family in args.families:
        for rows, median in step_times(family, rows_list, args.rounds).items():
            lines.append(
                f"| {family} | {rows} | {median['mlx'] * 1e3:.1f} ms | "
                f"{median['kernels'] * 1e3:.1f} ms | {median['mlx'] / median['kernels']:.2f}x |"
            )
    publish(lines, args.out, "vision-decode")


if __name__ == "__main__":
    main()
