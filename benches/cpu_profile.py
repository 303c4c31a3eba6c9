"""Where a decode step and a prefill chunk spend their time on this CPU, before and after
mlxgate's CPU kernels, against the machine's memory bandwidth (one run, interleaved).

    .venv/bin/python benches/cpu_profile.py [--rounds 3]

The embedded model (SmolLM2-135M) twice: as served before the kernels (its Q4_1 GGUF
dequantized to float32, MLX's ops with OpenBLAS) and as served now (the 4-bit weights as
stored, mlxgate's kernels). For each, per decode step at 1 and 32 rows (64 tokens of context)
and per 256-token prefill chunk at 1k and 12k tokens of context: the whole pass, the matmuls
alone (every linear layer and the LM head at the pass's shapes), the norms and ropes alone,
the rest (attention, the other ops, their dispatch and Python), and the ops in the graph
(`mx.export_to_dot`). A copy probe gives the bandwidth; the weights' bytes over it is the
least time a decode step can take.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from report import publish

DECODE_ROWS = (1, 32)
CONTEXTS = (1024, 12288)
CHUNK = 256


def bandwidth() -> float:
    """Bytes a second one thread reads (numpy's sum over 256 MB, best of five)."""
    import numpy as np

    data = np.ones(64 << 20, dtype=np.float32)
    best = min(_timed(data.sum) for _ in range(5))
    return data.nbytes / best


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def variant(name: str) -> Any:
    import mlx.core as mx

    from mlxgate.models import load

    weights = "float32" if name == "before" else "quantized"
    model = load(None, weights=weights, cpu_kernels=name == "after").model
    mx.eval(model.parameters())
    return model


def filled_cache(model: Any, rows: int, context: int) -> list[Any]:
    """A cache holding `context` tokens of random keys and values (what a prefill leaves)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    args = model.args
    heads = args.num_key_value_heads
    dim = args.hidden_size // args.num_attention_heads
    for layer in cache:
        keys = mx.random.normal((rows, heads, context, dim)) * 0.5
        layer.update_and_fetch(keys, keys * 0.7)
    mx.eval([layer.state for layer in cache])
    return cache


def pass_parts(model: Any, rows: int, tokens: int, context: int) -> dict[str, float]:
    """Seconds of one forward pass of `tokens` new tokens over `context` cached, and its parts."""
    import mlx.core as mx
    import mlx.nn as nn

    cache = filled_cache(model, rows, context)
    inputs = mx.array([[(13 * i + r) % 4000 + 10 for i in range(tokens)] for r in range(rows)])
    hidden = mx.random.normal((rows, tokens, model.args.hidden_size))
    mx.eval(inputs, hidden)

    def forward() -> None:
        for layer in cache:  # the same context each time
            layer.offset = context
        out = model(inputs, cache=cache)
        mx.eval(out[:, -1, :] if tokens > 1 else out)

    def matmuls() -> None:
        outs = []
        for _, module in model.named_modules():
            if isinstance(module, nn.QuantizedLinear | nn.Linear):
                width = module.weight.shape[1] * (32 // getattr(module, "bits", 32))
                outs.append(module(mx.zeros((rows, tokens, width))))
        outs.append(model.model.embed_tokens.as_linear(hidden[:, -1:, :]))
        mx.eval(outs)

    def norms_and_ropes() -> None:
        outs = []
        for layer in model.model.layers:
            outs.append(layer.input_layernorm(hidden))
            outs.append(layer.post_attention_layernorm(hidden))
            attention = layer.self_attn
            queries = hidden.reshape(rows, tokens, attention.n_heads, -1).transpose(0, 2, 1, 3)
            keys = queries[:, : attention.n_kv_heads]
            outs.append(attention.rope(queries, offset=context))
            outs.append(attention.rope(keys, offset=context))
        mx.eval(outs)

    forward()  # warm-up
    parts = {
        "pass": min(_timed(forward) for _ in range(3)),
        "matmuls": min(_timed(matmuls) for _ in range(3)),
        "norms+ropes": min(_timed(norms_and_ropes) for _ in range(3)),
    }
    parts["rest"] = parts["pass"] - parts["matmuls"] - parts["norms+ropes"]
    return parts


def op_count(model: Any, rows: int) -> int:
    import tempfile

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out = model(mx.zeros((rows, 1), dtype=mx.int32), cache=make_prompt_cache(model))
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, out)
        return sum(1 for line in dot if "label" in line and "rank=" not in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    from mlx.utils import tree_flatten

    from mlxgate import blas
    from mlxgate.models import precision
    from mlxgate.models.cpu import kernels

    models = {name: variant(name) for name in ("before", "after")}
    shapes = [(f"decode, {r} row(s)", r, 1, 64) for r in DECODE_ROWS] + [
        (f"prefill chunk of {CHUNK} at {c // 1024}k", 1, CHUNK, c) for c in CONTEXTS
    ]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    read_rate = []
    for round_ in range(args.rounds):
        read_rate.append(bandwidth())
        for label, rows, tokens, context in shapes:
            for name, model in models.items():
                parts = pass_parts(model, rows, tokens, context)
                samples.setdefault((label, name), []).append(parts)
                print(f"round {round_ + 1}, {label}, {name}: {parts}", flush=True)

    rate = statistics.median(read_rate)
    lines = [
        f"# Where a pass spends its time, before and after the CPU kernels "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/cpu_profile.py --rounds {args.rounds}`: SmolLM2-135M on this CPU, BLAS "
        f"{blas.blas_in_use()}. Before: {precision(models['before'])}, MLX's ops. After: "
        f"{precision(models['after'])}, {kernels.describe()}. Medians over the rounds of "
        "the best of three; the parts are timed alone at the pass's shapes.",
        "",
        f"Memory bandwidth (one thread reading): {rate / 1e9:.1f} GB/s.",
        "",
        "| | weights read a step | least decode step at that bandwidth | ops in a decode step |",
        "| --- | --- | --- | --- |",
    ]
    for name, model in models.items():
        parameters: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        weight_bytes = sum(array.nbytes for _, array in parameters)
        lines.append(
            f"| {name} | {weight_bytes / 1e6:.0f} MB | {weight_bytes / rate * 1e3:.1f} ms | "
            f"{op_count(model, 1)} |"
        )
    lines += [
        "",
        "| pass | weights | whole pass | matmuls | norms + ropes | rest (attention, other ops, "
        "dispatch, Python) | after / before |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, *_ in shapes:
        whole = {}
        for name in models:
            parts = {
                key: statistics.median(s[key] for s in samples[(label, name)])
                for key in ("pass", "matmuls", "norms+ropes", "rest")
            }
            whole[name] = parts["pass"]
            ratio = f"{whole['after'] / whole['before']:.2f}x" if name == "after" else ""
            lines.append(
                f"| {label} | {name} | {parts['pass'] * 1e3:.1f} ms | "
                f"{parts['matmuls'] * 1e3:.1f} ms | {parts['norms+ropes'] * 1e3:.1f} ms | "
                f"{parts['rest'] * 1e3:.1f} ms | {ratio} |"
            )
    publish(lines, args.out, "cpu-profile")


if __name__ == "__main__":
    main()
