"""Where each family's decode step and prefill chunk spend their time with mlxgate's kernels on:
the architecture matrix's families at one small real model's shape, 4 bits, on this CPU.

    PYTHONPATH=tests .venv/bin/python benches/family_profile.py [--families llama gemma3_text ...]
        [--rounds 3]

No real checkpoints of most families can be had offline: each is mlx-lm's own class with random
weights (tests/support/tiny_models.py's config of it), resized to SmolLM2-135M's widths (hidden
576, MLP 1536, 9 query heads of 64 features over 3 key heads) with 8 layers and a 32k
vocabulary, and quantized as `mlx_lm.convert -q` does (4 bits, groups of 32). A family whose code
does not take that shape keeps its tiny config's and says so. Per family, medians over the
rounds of: a decode step at 1 and 32 rows (64 tokens of context) and a 256-token prefill chunk
(at 1k) with the kernels (the least of three passes), the decode steps on MLX's own ops too (the
same weights, one pass a round; a chunk there takes a minute with its context), interleaved round
by round, and the kernels' pass's
parts timed alone at its shapes: the linear layers (`nn.QuantizedLinear`, the LM head included),
the norms (every module whose class name ends in "Norm"), and the rest (attention, ropes,
activations, expert routing and gathers, recurrent scans, every other op and its dispatch).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from report import publish

FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma2",
    "phi3",
    "olmo2",
    "smollm3",
    "hunyuan_v1_dense",
    "ministral3",
    "qwen3_moe",
    "gpt_oss",
    "lfm2",
]
SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "moe_intermediate_size": 384,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "vocab_size": 32768,
    "block_dim": 576,
    "block_ff_dim": 1536,
    "query_pre_attn_scalar": 64,
}
CONTEXT = 64
CHUNK = 256
CHUNK_CONTEXT = 1024


def build(family: str) -> tuple[Any, str]:
    """The family's model at SHAPE (or its tiny shape where SHAPE does not fit), quantized."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model

    from support import tiny_models

    for shape, label in ((SHAPE, "576 wide, 8 layers"), ({}, "tiny (its code refused 576)")):
        cfg = {**tiny_models.config(family), **shape}
        if family == "lfm2" and shape:
            cfg["num_hidden_layers"] = 4  # its layer_types name four layers
        try:
            model_class, args_class = _get_classes(cfg)
            mx.random.seed(0)
            model = model_class(args_class.from_dict(cfg))
            quantize_model(model, cfg, group_size=32, bits=4)
            mx.eval(model.parameters())
            model(mx.zeros((1, 4), dtype=mx.int32))  # its code takes the shape
            return model, label
        except (ValueError, TypeError, AssertionError, KeyError):
            if not shape:
                raise
    raise AssertionError("unreachable")


def timed(fn: Any, repeats: int = 3) -> float:
    """The least of `repeats` runs of `fn` after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def parts(
    model: Any, rows: int, tokens: int, context: int, whole_only: bool = False
) -> dict[str, float]:
    """Seconds of one pass of `tokens` new tokens over `context` cached, and of its parts (or
    the pass alone)."""
    import mlx.core as mx
    import mlx.nn as nn

    cache = model.make_cache() if hasattr(model, "make_cache") else None
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    if rows > 1:
        from mlx_lm.generate import _merge_caches

        singles = []
        for _ in range(rows):
            one = model.make_cache() if hasattr(model, "make_cache") else None
            if one is None:
                from mlx_lm.models.cache import make_prompt_cache

                one = make_prompt_cache(model)
            model(mx.random.randint(10, 1000, (1, context)), cache=one)
            singles.append(one)
        cache = _merge_caches(singles)
    else:
        model(mx.random.randint(10, 1000, (1, context)), cache=cache)
    mx.eval([c.state for c in cache])
    inputs = mx.random.randint(10, 1000, (rows, tokens))

    def forward() -> None:
        out = model(inputs, cache=cache)
        mx.eval(out[:, -1, :])
        for layer in cache:  # back to the same context (a rotating or recurrent cache keeps the
            if hasattr(layer, "trim") and layer.is_trimmable():  # new state: close enough here)
                layer.trim(tokens)

    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    norms = [m for _, m in model.named_modules() if type(m).__name__.endswith("Norm")]
    widths: dict[int, mx.array] = {}

    def activations(width: int) -> mx.array:
        if width not in widths:
            widths[width] = mx.random.normal((rows, tokens, width))
        return widths[width]

    def matmuls() -> None:
        mx.eval([m(activations(m.weight.shape[1] * 32 // m.bits)) for m in linears])

    def norm_ops() -> None:
        outs = []
        for m in norms:
            weight = getattr(m, "weight", None)
            if weight is not None and weight.ndim == 1:
                outs.append(m(activations(weight.shape[0])))
        mx.eval(outs)

    if whole_only:  # (MLX's own ops take seconds a prefill chunk: one timed run a round)
        return {"pass": timed(forward, repeats=1)}
    whole = timed(forward)
    found = {"pass": whole, "linear layers": timed(matmuls), "norms": timed(norm_ops)}
    found["rest"] = whole - found["linear layers"] - found["norms"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate.models.cpu import install_kernels, kernels

    passes = [
        ("decode, 1 row", 1, 1, CONTEXT),
        ("decode, 32 rows", 32, 1, CONTEXT),
        (f"{CHUNK}-token chunk at 1k", 1, CHUNK, CHUNK_CONTEXT),
    ]
    lines = [
        "# Each family's pass, split by what it runs, with the kernels and without "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/family_profile.py --rounds {args.rounds} --families {' '.join(args.families)}`: "
        "mlx-lm's classes with random "
        f"weights, 4 bits in groups of 32; {kernels.describe()}. Each cell: the whole pass, then "
        "its linear layers, norms and the rest (attention, ropes, activations, expert gathers, "
        "recurrent scans, other ops and dispatch) as shares of it; before the arrow, the same "
        "decode step on MLX's own ops (the same weights, no kernels).",
        "",
        "| family | shape | " + " | ".join(label for label, *_ in passes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in passes) + " |",
    ]
    for family in args.families:
        try:
            model, shape = build(family)
        except Exception as exc:  # a family this script cannot build: said, not hidden
            lines.append(f"| {family} | not built: {type(exc).__name__}: {exc} | |")
            continue
        before, _ = build(family)  # the same weights, on MLX's own ops
        install_kernels(model)
        cells = []
        for label, rows, tokens, context in passes:
            samples = []
            plain = []
            try:
                for _ in range(args.rounds):  # interleaved: the machine's speed drifts
                    samples.append(parts(model, rows, tokens, context))
                    if tokens == 1:  # (a chunk on MLX's own ops takes a minute with its context)
                        plain.append(parts(before, rows, tokens, context, True)["pass"])
            except Exception as exc:  # mlx-lm's own code refusing the batch: said in the cell
                cells.append(f"failed in mlx-lm's code: {type(exc).__name__}: {exc}")
                continue
            median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            share = {k: max(0.0, median[k]) / median["pass"] for k in median if k != "pass"}
            was = f"{statistics.median(plain) * 1e3:.1f} -> " if plain else ""
            cells.append(
                f"{was}{median['pass'] * 1e3:.1f} ms: "
                f"{share['linear layers']:.0%} linear, {share['norms']:.0%} norms, "
                f"{share['rest']:.0%} rest"
            )
            print(f"{family}, {label}: {median}, on MLX's ops {plain}", flush=True)
        lines.append(f"| {family} | {shape} | " + " | ".join(cells) + " |")
    publish(lines, args.out, "family-profile")


if __name__ == "__main__":
    main()
