"""The opt-in int8-activation path (`--int8-activations`): not exact, faster where a step is
bound by its multiply-adds (many streams, prefill).

llama.cpp multiplies its quantized weights by activations quantized to 8 bits, as integers.
Here each quantized matrix of a model (nn.QuantizedLinear, and a tied head's
nn.QuantizedEmbedding) gets a second copy of its weight in the kernels' int8 layout: the groups
of a row taken eight at a time, each 32-byte chunk holding four bytes of each of the eight, so
that a group's integer products sum in one 32-bit lane of AVX2's maddubs (or AVX-512 VNNI's
vpdpbusd) and are converted and scaled once a group. A call of at least `min_rows` rows takes
that path, with x quantized per group (max |x| / 127); fewer rows (a decode step of one
stream, bound by reading the weights) keep the exact kernel, and so do a prefill chunk's rows
on a CPU without AVX-512 VNNI (OpenBLAS's sgemm is as fast there). The copy costs the quantized
weights' memory once more (4-bit weights as nibbles, scales and biases as float32).

Token agreement with the exact path and the speed it buys: benches/int8_agreement.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxgate.models.cpu import kernels

LANES = 8  # groups a lane set holds (kernels.h: INT8_LANES)
MIN_ROWS = 2  # from how many rows a matmul takes the int8 path (benches/int8_agreement.py)


def layout(
    weight: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    """A quantized matrix (MLX's affine layout: element j of a row at bit j * bits) in the int8
    layout: packed bytes [n, padded groups * group * bits / 8], float32 scales and biases
    [n, padded groups]; padding groups are zeros."""
    n = weight.shape[0]
    raw = np.asarray(weight).view(np.uint8).reshape(n, -1)
    if bits == 4:
        q = np.empty((n, raw.shape[1] * 2), np.uint8)
        q[:, 0::2], q[:, 1::2] = raw & 0x0F, raw >> 4
    else:
        q = raw
    groups = q.shape[1] // group
    padded = -(-groups // LANES) * LANES
    q = np.pad(q.reshape(n, groups, group), ((0, 0), (0, padded - groups), (0, 0)))
    # [n, set, lane, chunk, 4 bytes] -> [n, set, chunk, lane, 4 bytes]: a chunk, four bytes a lane
    chunks = q.reshape(n, padded // LANES, LANES, group // 4, 4).transpose(0, 1, 3, 2, 4)
    if bits == 4:  # each 32 bytes: chunk 2u in the low nibbles, 2u + 1 in the high ones
        pairs = chunks.reshape(n, padded // LANES, group // 8, 2, 32)
        chunks = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).astype(np.uint8)
    packed = np.ascontiguousarray(chunks).reshape(n, -1)

    def widened(a: mx.array) -> mx.array:
        return mx.array(np.pad(np.asarray(a.astype(mx.float32)), ((0, 0), (0, padded - groups))))

    return mx.array(packed), widened(scales), widened(biases)


class Int8Weight:
    """A module's weight in the int8 layout (a plain attribute: not one of its parameters)."""

    def __init__(self, module: nn.Module, min_rows: int) -> None:
        self.packed, self.scales, self.biases = layout(
            module["weight"], module["scales"], module["biases"], module.group_size, module.bits
        )
        mx.eval(self.packed, self.scales, self.biases)
        self.group, self.bits, self.min_rows = module.group_size, module.bits, min_rows

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def takes(self, x: mx.array) -> bool:
        """From min_rows rows; on AVX2 alone (no VNNI) not from the rows the exact kernel gives
        to OpenBLAS's sgemm (a prefill chunk), which maddubs does not beat."""
        if x.dtype != mx.float32:
            return False
        rows = x.size // max(1, x.shape[-1])
        return rows >= self.min_rows and (rows < _sgemm_rows() or _vnni())

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.extension().int8_matmul(
            x, self.packed, self.scales, self.biases, group_size=self.group, bits=self.bits
        )


def _sgemm_rows() -> int:
    rows: int = kernels.extension().sgemm_rows()
    return rows if rows > 0 else 1 << 30


@cache
def _vnni_cpu() -> bool:
    return bool(kernels.extension().vnni_supported())


def _vnni() -> bool:
    """VNNI in use: the CPU has it (asked once) and AVX-512 is on (switchable at run time)."""
    return _vnni_cpu() and bool(kernels.extension().using_avx512())


_classes: dict[type, type] = {}


def _with_int8(cls: type) -> type:
    """`cls` (QuantizedLinear or QuantizedEmbedding, or the subclass the kernels gave it) whose
    matmul takes the int8 path from `min_rows` rows, else is `cls`'s own."""
    if cls in _classes:
        return _classes[cls]

    def linear(self: Any, x: mx.array) -> mx.array:
        if not self._int8.takes(x):
            return cls.__call__(self, x)  # type: ignore[operator]
        out = self._int8(x)
        return out + self["bias"] if "bias" in self else out

    def as_linear(self: Any, x: mx.array) -> mx.array:
        if not self._int8.takes(x):
            return cls.as_linear(self, x)  # type: ignore[attr-defined,no-any-return]
        return self._int8(x)

    methods = (
        {"__call__": linear} if issubclass(cls, nn.QuantizedLinear) else {"as_linear": as_linear}
    )
    _classes[cls] = type(cls.__name__, (cls,), methods)
    return _classes[cls]


def _fits(module: nn.Module) -> bool:
    bits, group = module.bits, module.group_size
    return (
        getattr(module, "mode", "affine") == "affine"
        and "biases" in module
        and module["weight"].ndim == 2
        and module["scales"].dtype in (mx.float16, mx.bfloat16, mx.float32)
        and (bits, group) in ((4, 32), (4, 64), (8, 16), (8, 32), (8, 64))
    )


def install(model: nn.Module, min_rows: int = MIN_ROWS) -> tuple[int, int]:
    """Give `model`'s quantized matrices the int8 path (a tied head's embedding too, where the
    model has no separate lm_head). Returns (matrices, bytes of their int8 copies); (0, 0)
    where the kernels cannot serve (another device, no AVX2)."""
    if kernels.unavailable() is not None or mx.default_device() != mx.cpu:
        return 0, 0
    modules = list(model.named_modules())
    untied = any(name.split(".")[-1] == "lm_head" for name, _ in modules)
    count = size = 0
    for _, module in modules:
        linear = isinstance(module, nn.QuantizedLinear)
        head = isinstance(module, nn.QuantizedEmbedding) and not untied
        if (linear or head) and _fits(module) and not hasattr(module, "_int8"):
            module._int8 = Int8Weight(module, min_rows)
            module.__class__ = _with_int8(type(module))
            count, size = count + 1, size + module._int8.nbytes
    return count, size


def nbytes(model: nn.Module) -> int:
    """The memory of `model`'s int8 copies (beside its parameters)."""
    return sum(m._int8.nbytes for m in model.modules() if hasattr(m, "_int8"))


@contextmanager
def suspended(model: nn.Module) -> Iterator[None]:
    """`model` computing exactly for a while, at every row count (the engine's start-up check
    that a batch computes as each sequence alone compares two row counts)."""
    weights = [m._int8 for m in model.modules() if hasattr(m, "_int8")]
    before = [w.min_rows for w in weights]
    for w in weights:
        w.min_rows = 1 << 30
    try:
        yield
    finally:
        for w, rows in zip(weights, before, strict=True):
            w.min_rows = rows
