"""A loaded model's attention on CPU: the one place that decides which attention its layers run.

mlx-lm's layers call its `scaled_dot_product_attention`; on one model instance (`install`,
through models/cpu/rebind.py) that becomes `kernel_attention` where mlxgate-kernels serve
(models/cpu/kernels.py: one pass over the keys, where that is faster than the rest), else this
module's `scaled_dot_product_attention`, which keeps mlx-lm's own where it does not pay off.
Both attend band by band over a cache kept in bands (`Banded`: engine/banded_cache.py).

MLX's CPU backend computes `exp` one element at a time (~25 ns each), and its CPU
`mx.fast.scaled_dot_product_attention` is composed of plain ops. At 32 decoding rows and 210
tokens of context that attention took 5.5 ms of a layer's ~12 ms. Here it is written out:

- Query heads that share a key/value head become more rows of one matmul.
- Decode steps and small prefill chunks keep the softmax in the MLX graph, with `fast_exp`'s
  exp (~5 ns per score): 5.5 -> 2.5 ms per layer for the step above, a 32-row decode step
  14-21% faster.
- Large prefill chunks run the softmax in numpy, whose vectorised `exp` is faster still on
  millions of scores: a 256-token chunk's attention at 4k tokens of context takes 2.2x less
  time than MLX's and 2.8x less than the compiled exp's, which is memory-bound at that size.
  Each such layer hands the GIL to numpy and back, which decode steps cannot afford: in the
  server the engine then waits on the event loop (C=32 fell 10-17% when decode went this way).
- The smallest (one sequence, short context) keep MLX's own attention: fewer ops to launch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base

from mlxgate.models.cpu import fast_exp, kernels, rebind

# The global mlx-lm's attention code calls.
_NAME = "scaled_dot_product_attention"

# Attention scores per layer (batch x heads x queries x keys) from which each way pays off:
# below MLX_SCORES MLX's own attention has fewer ops to launch, from NUMPY_SCORES on numpy's exp
# wins.
MLX_SCORES = 1 << 11
NUMPY_SCORES = 1 << 18

_TINY = float(np.finfo(np.float32).tiny)  # the row sum of an all-masked row: zeros, not NaN

# Where the attention kernel is faster than `scaled_dot_product_attention` (two OpenBLAS matmuls
# around a softmax), per layer of the embedded model (9 query heads, 3 key heads, 64 features;
# benches/attention_kernel.py). With AVX-512 (four query rows sharing each key): everywhere
# measured, from 0.75x the time at 256 queries and 512 keys to 0.19x at 8k keys. With AVX2
# only: always for a few queries (decode, verify: 0.48 against 1.09 ms at 32 rows and 200 keys),
# and for a prefill chunk from ~2k keys on (256 queries: 15 against 31 ms at 2k keys, 58 against
# 110 at 8k); below that OpenBLAS wins (6 against 3 ms at 512 keys).
KERNEL_QUERIES = 8
KERNEL_KEYS = 2048


class Banded:
    """A layer's cache kept in bands of a batch's rows (engine/banded_cache.py's BandedCache):
    its `update_and_fetch` and `make_mask` give one keys, values and mask per band, `split`
    cuts the queries the same way, and the attention attends band by band."""

    bands: list[Any]

    def split(self, rows: mx.array) -> list[mx.array]:
        """`rows` (batch first) cut into the bands' parts."""
        raise NotImplementedError


@partial(mx.compile, shapeless=True)
def _shifted_exp_parts(scores: mx.array) -> tuple[mx.array, mx.array]:
    """exp(scores - row max) as `fast_exp.exp2_parts` gives it."""
    peak = mx.maximum(scores.max(axis=-1, keepdims=True), -3.0e38)  # finite for all-masked rows
    return fast_exp.exp2_parts((scores - peak) * fast_exp.LOG2E)


def _softmax_mlx(scores: mx.array) -> tuple[mx.array, mx.array]:
    """Unnormalised softmax of the last axis and its row sums (divide after the value matmul)."""
    fraction, exponent_bits = _shifted_exp_parts(scores)
    weights = fraction * fast_exp.power_of_two(exponent_bits)
    return weights, mx.maximum(weights.sum(axis=-1, keepdims=True), _TINY)


def _softmax_numpy(scores: mx.array, mask: mx.array | str | None, n: int, t: int) -> mx.array:
    """Normalised softmax of scores [batch, kv_heads, repeats * n, t], computed in numpy."""
    batch, kv_heads, rows, _ = scores.shape
    probs = np.array(scores).reshape(batch, kv_heads, rows // n, n, t)
    if mask is not None:
        array = np.asarray(_grouped_mask(mask, kv_heads, n, t))
        probs += (
            np.where(array, np.float32(0.0), np.float32(-np.inf))
            if array.dtype == np.bool_
            else array
        )
    peak = probs.max(axis=-1, keepdims=True)
    peak[~np.isfinite(peak)] = 0.0  # a row with every key masked gives zeros, not NaN
    probs -= peak
    np.exp(probs, out=probs)
    probs /= np.maximum(probs.sum(axis=-1, keepdims=True), _TINY)
    return mx.array(probs.reshape(batch, kv_heads, rows, t))


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` in MLX ops without MLX's `exp` (mlx-lm's own
    where that does not pay off or apply)."""
    if isinstance(cache, Banded):
        return _band_by_band(
            scaled_dot_product_attention, queries, keys, values, cache, scale, mask, sinks
        )
    batch, heads, n, head_dim = queries.shape
    if (
        hasattr(cache, "bits")  # keys/values as (packed, scales, biases): mlx-lm's quantized way
        or sinks is not None
        or queries.dtype != mx.float32
        or batch * heads * n * keys.shape[2] < MLX_SCORES
    ):
        return base.scaled_dot_product_attention(
            queries,
            keys,
            values,
            cache=cache,
            scale=scale,
            mask=mask,  # type: ignore[arg-type]
            sinks=sinks,
        )
    kv_heads, t = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, repeats * n, head_dim)
    scores = q @ keys.swapaxes(-1, -2)
    if batch * heads * n * t >= NUMPY_SCORES:
        out = _softmax_numpy(scores, mask, n, t) @ values
    else:
        if mask is not None:
            scores = _masked(scores, mask, n, t)
        weights, sums = _softmax_mlx(scores)
        out = (weights @ values) / sums
    return out.reshape(batch, heads, n, values.shape[-1])  # MLA values are narrower than keys


def kernel_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` with the kernel, over float keys and values or a
    quantized cache's (`--kv-bits`: dequantized a key head at a time inside the kernel, where
    mlx-lm's way is MLX's generic quantized matmul); a row whose keys are all masked (a padded
    slot) gives zeros, as `scaled_dot_product_attention`'s does."""
    if isinstance(cache, Banded):
        return _band_by_band(kernel_attention, queries, keys, values, cache, scale, mask, sinks)
    extension = kernels.extension()
    if hasattr(cache, "bits") and sinks is None:  # keys/values as (packed, scales, biases)
        out = extension.quantized_scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            group_size=cache.group_size,
            bits=cache.bits,
        )
        if out is not None:
            return out  # type: ignore[no-any-return]
    if (
        sinks is not None
        or hasattr(cache, "bits")
        or not (
            extension.using_avx512()
            or queries.shape[2] <= KERNEL_QUERIES
            or keys.shape[2] >= KERNEL_KEYS
        )
    ):
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return extension.scaled_dot_product_attention(  # type: ignore[no-any-return]
        queries, keys, values, scale=scale, mask=mask
    )


def _band_by_band(
    attention: Callable[..., mx.array],
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Banded,
    scale: float,
    mask: Any,
    sinks: mx.array | None,
) -> mx.array:
    """`attention` over a banded cache, band by band: its update_and_fetch and make_mask gave one
    keys, values and mask per band."""
    bands = zip(cache.split(queries), keys, values, cache.bands, mask, strict=True)
    return mx.concatenate([attention(q, k, v, c, scale, m, sinks) for q, k, v, c, m in bands])


def _masked(scores: mx.array, mask: mx.array | str, n: int, t: int) -> mx.array:
    """Scores [batch, kv_heads, repeats * n, t] with masked keys at -inf."""
    batch, kv_heads, rows, _ = scores.shape
    array = _grouped_mask(mask, kv_heads, n, t)
    grouped = scores.reshape(batch, kv_heads, rows // n, n, t)
    grouped = mx.where(array, grouped, -mx.inf) if array.dtype == mx.bool_ else grouped + array
    return grouped.reshape(batch, kv_heads, rows, t)


def _grouped_mask(mask: mx.array | str, kv_heads: int, n: int, t: int) -> mx.array:
    """The mask (boolean, or additive) shaped to broadcast over scores grouped as
    [batch, kv_heads, repeats, n, t]."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        return base.create_causal_mask(n, offset=t - n)
    if mask.ndim == 4 and mask.shape[1] > 1:  # one per query head (MLA's position scores)
        return mask.reshape(mask.shape[0], kv_heads, -1, n, t)
    return mask[:, :, None] if mask.ndim == 4 else mask  # [batch, 1, n, t] for every head


def installed(model: nn.Module) -> bool:
    """Whether `model`'s attention goes through this module (and so can take a `Banded` cache)."""
    return any(
        rebind.installed(model, _NAME, attention)
        for attention in (scaled_dot_product_attention, kernel_attention)
    )


def _originals() -> list[Callable[..., mx.array]]:
    """The attentions model code calls under `_NAME`: mlx-lm's, and mlx-vlm's for its language
    models (the same arguments and results, plus caches mlxgate never makes) once an mlx-vlm
    model's code has imported it (a text model's load does not pay for importing mlx-vlm)."""
    found = [base.scaled_dot_product_attention]
    vlm_base = sys.modules.get("mlx_vlm.models.base")
    if vlm_base is not None:
        found.append(vlm_base.scaled_dot_product_attention)
    return found


def install(model: nn.Module, kernel: bool = True) -> bool:
    """Route the attention of `model` (this instance only, CPU only) through this module: its
    `scaled_dot_product_attention`, and with `kernel`, where mlxgate-kernels serve on this
    machine, `kernel_attention` in front of it. Returns whether any layer took it."""
    taken = False
    for original in _originals():
        taken |= rebind.install(model, _NAME, original, scaled_dot_product_attention)
    if kernel and kernels.unavailable() is None:
        rebind.install(model, _NAME, scaled_dot_product_attention, kernel_attention)
    return taken
