"""mlxgate's CPU kernels (the `mlxgate-kernels` package, kernels/) on one model instance.

The kernels are MLX primitives written for x86 CPUs with AVX2: a quantized matmul that
dequantizes MLX's affine 4- and 8-bit weights in registers and reads each weight once for all
the rows of a step, single-op RMSNorm and RoPE (MLX composes these from ~10 ops each on the
CPU), and attention in one pass over the keys (MLX's CPU attention is a dozen ops and the whole
score matrix). A model's modules call the first three as `mx.quantized_matmul`,
`mx.fast.rms_norm` and `mx.fast.rope` (nn.QuantizedLinear, nn.QuantizedEmbedding, nn.RMSNorm,
mlx-lm's ropes): each of this model's modules is given a copy of `mlx.core` in which those are
the kernels (models/kernels.py), so no other model in the process changes. Attention is mlx-lm's
`scaled_dot_product_attention`, which models/cpu_attention.py already replaces on the instance;
here it is replaced again by `attention`. Each kernel is MLX's own op wherever it does not apply
(another device or dtype, 3-bit weights, attention sinks...).
"""

from __future__ import annotations

import platform
import types
from functools import cache
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from mlxgate.models import cpu_attention, kernels
from mlxgate.models.banded_cache import BandedCache


@cache
def _extension() -> Any:
    """The mlxgate_kernels module, or a string saying why it cannot serve here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"written for x86-64 CPUs, this is {platform.machine()}"
    try:
        import mlxgate_kernels
    except ImportError as exc:
        return f"mlxgate-kernels is not installed ({exc}); `make env` builds it"
    if not mlxgate_kernels.cpu_supported():
        return "this CPU lacks AVX2, FMA or F16C"
    return mlxgate_kernels


def unavailable() -> str | None:
    """Why the kernels cannot serve on this machine, or None when they can."""
    found = _extension()
    return found if isinstance(found, str) else None


def describe() -> str:
    found = _extension()
    if isinstance(found, str):
        return f"MLX's own ({found})"
    return f"mlxgate's AVX2 kernels ({found.threads()} threads)"


@cache
def _mlx_core_with_kernels() -> types.ModuleType:
    """A copy of `mlx.core` whose quantized_matmul, fast.rms_norm and fast.rope are the kernels."""
    extension = _extension()
    fast = types.ModuleType(mx.fast.__name__)
    fast.__dict__.update(vars(mx.fast))
    fast.__dict__.update(rms_norm=extension.rms_norm, rope=extension.rope)
    core = types.ModuleType(mx.__name__)
    core.__dict__.update(vars(mx))
    core.__dict__.update(fast=fast, quantized_matmul=extension.quantized_matmul)
    return core


# Where the attention kernel is faster than models/cpu_attention.py's (two OpenBLAS matmuls
# around a softmax), per layer of the embedded model (9 query heads, 3 key heads, 64 features;
# benches/attention_kernel.py). With AVX-512 (four query rows sharing each key): everywhere
# measured, from 0.75x the time at 256 queries and 512 keys to 0.19x at 8k keys. With AVX2
# only: always for a few queries (decode, verify: 0.48 against 1.09 ms at 32 rows and 200 keys),
# and for a prefill chunk from ~2k keys on (256 queries: 15 against 31 ms at 2k keys, 58 against
# 110 at 8k); below that OpenBLAS wins (6 against 3 ms at 512 keys).
KERNEL_QUERIES = 8
KERNEL_KEYS = 2048


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` with the kernel; a row whose keys are all masked
    (a padded slot) gives zeros, as models/cpu_attention.py's does."""
    if isinstance(cache, BandedCache):
        # Its update_and_fetch and make_mask gave one keys, values and mask per band.
        masks = cast(list[Any], mask)
        bands = zip(cache.split(queries), keys, values, cache.bands, masks, strict=True)
        return mx.concatenate([attention(q, k, v, c, scale, m, sinks) for q, k, v, c, m in bands])
    extension = _extension()
    if (
        sinks is not None
        or hasattr(cache, "bits")  # keys/values as (packed, scales, biases)
        or not (
            extension.using_avx512()
            or queries.shape[2] <= KERNEL_QUERIES
            or keys.shape[2] >= KERNEL_KEYS
        )
    ):
        return cpu_attention.scaled_dot_product_attention(
            queries, keys, values, cache, scale, mask, sinks
        )
    return extension.scaled_dot_product_attention(  # type: ignore[no-any-return]
        queries, keys, values, scale=scale, mask=mask
    )


cpu_attention.TAKE_BANDS.append(attention)


def install(model: nn.Module) -> bool:
    """Give `model`'s modules the kernels; False (nothing changed) where they cannot serve.
    After models/cpu_attention.py's `install`, whose attention this one replaces."""
    if unavailable() is not None:
        return False
    kernels.install(
        model, "scaled_dot_product_attention", cpu_attention.scaled_dot_product_attention, attention
    )
    return kernels.install(model, "mx", mx, _mlx_core_with_kernels())


def installed(model: nn.Module) -> bool:
    return unavailable() is None and kernels.installed(model, "mx", _mlx_core_with_kernels())
