"""A GGUF tensor as MLX arrays: its blocks as MLX's affine quantization where that is exact,
else its values (llama.cpp's `gguf` package decodes every block type) in float32.

Q6_K is held as 8 bits in groups of 16 (its sub-blocks), which only mlxgate's CPU kernels
multiply: where they do not serve, models/gguf widens those layers to float32 at load."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize

# Block type -> the width MLX stores its values at. Each is `scale * q + bias` per 32 values
# (Q4_K and Q5_K per 32-value sub-block: d * sc and -dmin * m; Q6_K per 16: d * sc and
# -32 * d * sc). 5- and 6-bit values are widened to 8 bits, which mlxgate's CPU kernels
# multiply (they take 4 and 8 bits).
AFFINE_BITS = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q4_K: 4,
    Q.Q5_0: 8,
    Q.Q5_1: 8,
    Q.Q5_K: 8,
    Q.Q6_K: 8,
    Q.Q8_0: 8,
}
# Values per scale and bias.
GROUP = 32
GROUPS = {Q.Q6_K: 16}
# Rows converted at a time (Gemma 3's embedding has 262,144).
_ROWS = 8192


def read(kind: Q, data: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The arrays of one tensor: `weight` and, when quantized, `scales` and `biases`.

    `data` is the tensor as `GGUFReader` holds it (rows of blocks for a block type). Scales and
    biases are float16 where that holds them exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: llama.cpp's
    own float16 d and m), else float32 (the K-quants' d * sc needs up to 18 bits). An
    embedding's rows come out in float32 all the same (models/gguf's `FloatRowsEmbedding`)."""
    if kind in AFFINE_BITS and data.ndim == 2:
        parts = [_affine(kind, data[row : row + _ROWS]) for row in range(0, len(data), _ROWS)]
        if all(part is not None for part in parts):
            weight, scales, biases = (
                np.concatenate([part[i] for part in parts if part is not None]) for i in range(3)
            )
            if _half_exact(scales) and _half_exact(biases):
                scales, biases = scales.astype(np.float16), biases.astype(np.float16)
            return {"weight": weight, "scales": scales, "biases": biases}
    return {"weight": values(kind, data)}


def served_as(kind: Q, arrays: dict[str, np.ndarray[Any, Any]]) -> str:
    """How `read` holds a tensor, e.g. "4-bit affine (float16 scales)", "8-bit affine in groups
    of 16 (float32 scales)", "float32"."""
    if "scales" not in arrays:
        return str(arrays["weight"].dtype)
    group = GROUPS.get(kind, GROUP)
    groups = "" if group == GROUP else f" in groups of {group}"
    return f"{AFFINE_BITS[kind]}-bit affine{groups} ({arrays['scales'].dtype} scales)"


def _half_exact(array: np.ndarray[Any, Any]) -> bool:
    return bool(np.array_equal(array.astype(np.float16).astype(np.float32), array))


def values(kind: Q, data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The tensor's values in float32: exact for every block type (F16 and BF16 widen; Q6_K's
    d * sc * q needs up to 24 bits) and what the CPU multiplies without a cast per step."""
    if kind == Q.F32:
        return np.asarray(data, dtype=np.float32)
    return np.asarray(dequantize(data, kind), dtype=np.float32)


def _header(kind: Q, blocks: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    """Per block: scale and bias of each group of its values, float32 (n_blocks, groups)."""
    if kind == Q.Q6_K:  # ql, qh, 16 int8 scales, then d
        d = blocks[:, -2:].copy().view(np.float16).astype(np.float32)
        scale = d * blocks[:, -18:-2].copy().view(np.int8).astype(np.float32)
        return scale, -32 * scale
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind in (Q.Q4_K, Q.Q5_K):
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE].copy())
        return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if kind in (Q.Q4_1, Q.Q5_1):
        return d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    offset = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128}[kind]
    return d, -offset * d


def _affine(kind: Q, data: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...] | None:
    """(packed uint32, scales, biases) in MLX's affine layout, or None where that would not give
    back exactly the values llama.cpp's dequantization gives."""
    bits, group = AFFINE_BITS[kind], GROUPS.get(kind, GROUP)
    exact = values(kind, data)  # (rows, columns)
    rows, columns = exact.shape
    blocks = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[kind][1])
    scale, bias = (part.reshape(rows, columns // group) for part in _header(kind, blocks))
    grouped = exact.reshape(rows, columns // group, group)
    safe = np.where(scale == 0, 1, scale)[..., None]
    q = np.where(scale[..., None] == 0, 0, np.rint((grouped - bias[..., None]) / safe))
    q = np.clip(q, 0, 2**bits - 1)
    if not np.array_equal(scale[..., None] * q + bias[..., None], grouped):
        return None
    per_word = 32 // bits
    words = q.astype(np.uint32).reshape(rows, columns // per_word, per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    packed = np.bitwise_or.reduce(words << shifts, axis=-1)
    return packed, scale, bias
