"""`exp` on CPU without MLX's own, and the SwiGLU activation built on it.

MLX's CPU backend calls libm's `exp` once per element, ~25 ns each. SwiGLU's sigmoid does that
for every MLP unit of every token: 2.2 of a layer's ~8 ms in a 32-row decode step, 16 ms of a
256-token prefill chunk's layer. Here 2^t = 2^n * 2^f with n = round(t) and f in [-1/2, 1/2]:
2^f is a degree-7 Taylor polynomial (error < 1e-8, below float32's resolution) and 2^n is n + 127
written into a float32's exponent bits. Fused by `mx.compile` that is ~5 ns per element, and
SwiGLU is 4-7x faster.

A bit view cannot go in a shapeless compiled function (MLX cannot infer its shape), so the
callers compile what comes before the view and what comes after it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations

from mlxgate.models.cpu import rebind

LOG2E = 1.4426950408889634
# Below this many elements (a few tokens' MLP units) MLX's one kernel launch is cheaper.
MIN_ELEMENTS = 1 << 13
_EXP2_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(8))


def exp2_parts(t: mx.array) -> tuple[mx.array, mx.array]:
    """2^t as (2^f, exponent bits of 2^n), for use inside a compiled function.

    t is clamped to [-127, 127]; at -127 the exponent bits are 0, an exact 0 (masked scores).
    """
    t = mx.clip(t, -127.0, 127.0)
    n = mx.round(t)
    f = t - n
    fraction = f * _EXP2_TAYLOR[-1] + _EXP2_TAYLOR[-2]
    for coefficient in reversed(_EXP2_TAYLOR[:-2]):
        fraction = fraction * f + coefficient
    return fraction, (n.astype(mx.int32) + 127) << 23


def power_of_two(exponent_bits: mx.array) -> mx.array:
    """The float32 2^n whose exponent bits `exp2_parts` gave."""
    return mx.view(exponent_bits, mx.float32)


@partial(mx.compile, shapeless=True)
def _exp_minus_parts(gate: mx.array) -> tuple[mx.array, mx.array]:
    return exp2_parts(-gate * LOG2E)


@partial(mx.compile, shapeless=True)
def _swiglu_from_parts(
    gate: mx.array, x: mx.array, fraction: mx.array, scale: mx.array
) -> mx.array:
    return gate * x / (1.0 + fraction * scale)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = gate * x / (1 + exp(-gate))."""
    if gate.dtype != mx.float32 or gate.size < MIN_ELEMENTS:  # the exponent bits are float32's
        return activations.swiglu(gate, x)
    fraction, exponent_bits = _exp_minus_parts(gate)
    return _swiglu_from_parts(gate, x, fraction, power_of_two(exponent_bits))


def install(
    model: nn.Module, replacement: Callable[[mx.array, mx.array], mx.array] = swiglu
) -> bool:
    """Give `model` (this instance only) this SwiGLU (or `replacement`) where it uses mlx-lm's or
    mlx-vlm's (CPU only)."""
    taken = rebind.install(model, "swiglu", activations.swiglu, replacement)
    vlm_activations = sys.modules.get("mlx_vlm.models.activations")  # imported by its models
    if vlm_activations is not None:
        taken = rebind.install(model, "swiglu", vlm_activations.swiglu, replacement) or taken
    return taken
