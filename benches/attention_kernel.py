"""The attention kernel against models/cpu/attention.py's attention in MLX ops (OpenBLAS matmuls
around a softmax), per layer of the embedded model's shape, in one run: where each is the faster
one.

    .venv/bin/python benches/attention_kernel.py

9 query heads over 3 key heads of 64 features, a causal mask; each case the best of five.
models/cpu/attention.py's KERNEL_QUERIES and KERNEL_KEYS come from this table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CASES = [  # (batch, queries, keys)
    (32, 1, 200),
    (1, 16, 300),
    (1, 64, 1000),
    (1, 256, 512),
    (1, 256, 1024),
    (1, 256, 2048),
    (1, 256, 4096),
    (1, 256, 8192),
    (1, 128, 4096),
]


def best_ms(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
    """Best of `repeats` times of evaluating fn(*args), in milliseconds."""
    import mlx.core as mx

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(fn(*args))
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    import mlxgate  # noqa: F401, I001  (preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    import mlxgate_kernels

    from mlxgate.models.cpu import attention

    def kernel(q: mx.array, k: mx.array, v: mx.array, mask: str | None) -> mx.array:
        return mlxgate_kernels.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    print("| batch | queries | keys | kernel | cpu_attention | kernel / cpu_attention |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, n, t in CASES:
        q = mx.random.normal((batch, n, 9, 64)).transpose(0, 2, 1, 3)
        k, v = mx.random.normal((batch, 3, t, 64)), mx.random.normal((batch, 3, t, 64))
        mask = "causal" if n > 1 else None
        mx.eval(q, k, v)
        ours = best_ms(kernel, q, k, v, mask)
        theirs = best_ms(attention.scaled_dot_product_attention, q, k, v, None, 0.125, mask)
        print(f"| {batch} | {n} | {t} | {ours:.2f} ms | {theirs:.2f} ms | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
