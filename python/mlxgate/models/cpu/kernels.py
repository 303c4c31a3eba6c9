"""mlxgate's CPU kernels (the `mlxgate-kernels` package, kernels/) on one model instance.

The kernels are MLX primitives written for x86 CPUs with AVX2: a quantized matmul that
dequantizes MLX's affine 4- and 8-bit weights in registers and reads each weight once for all
the rows of a step (and its gathered form for mixtures of experts, each expert's matrix read
once for the rows routed to it), single-op RMSNorm and RoPE (MLX composes these from ~10 ops
each on the CPU), the gated MLPs' SiLU and GELU (MLX calls libm once per element), and
attention in one pass over the keys (MLX's CPU attention is a dozen ops and the whole score
matrix). A model's modules call the first four as `mx.quantized_matmul`, `mx.gather_qmm`,
`mx.fast.rms_norm` and `mx.fast.rope` (nn.QuantizedLinear, nn.QuantizedEmbedding, mlx-lm's
QuantizedSwitchLinear, nn.RMSNorm, mlx-lm's ropes), the activations as mlx-lm's `swiglu` and
`nn.gelu_approx`: each of this model's modules is given a copy of `mlx.core` (and of `mlx.nn`,
and its own `swiglu`) in which those are the kernels (models/cpu/rebind.py), so no other model
in the process changes. The attention kernel is one of the ways models/cpu/attention.py picks
from for the model's attention. Each kernel is MLX's own op wherever it does not apply (another
device or dtype, 3-bit weights, attention sinks...).
"""

from __future__ import annotations

import platform
import types
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxgate.models.cpu import fast_exp, rebind


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


def extension() -> Any:
    """The mlxgate_kernels module, where `unavailable()` is None."""
    return _extension()


def describe() -> str:
    found = _extension()
    if isinstance(found, str):
        return f"MLX's own ({found})"
    return f"mlxgate's AVX2 kernels ({found.threads()} threads)"


def _copy_of(module: types.ModuleType, **replacements: Any) -> types.ModuleType:
    """A module object holding what `module` holds, with `replacements` in place."""
    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(vars(module))
    copy.__dict__.update(replacements)
    return copy


@cache
def _mlx_core_with_kernels() -> types.ModuleType:
    """A copy of `mlx.core` whose quantized_matmul, gather_qmm, fast.rms_norm and fast.rope are
    the kernels."""
    extension = _extension()
    fast = _copy_of(mx.fast, rms_norm=extension.rms_norm, rope=extension.rope)
    return _copy_of(
        mx,
        fast=fast,
        quantized_matmul=extension.quantized_matmul,
        gather_qmm=extension.gather_qmm,
    )


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's swiglu, silu(gate) * x, by the kernel (else by fast_exp's)."""
    out = _extension().activation(gate, x, kind="silu")
    return fast_exp.swiglu(gate, x) if out is None else out


def gelu_approx(x: mx.array) -> mx.array:
    """nn.gelu_approx (GELU's tanh form, Gemma's), by the kernel where it serves."""
    out = _extension().activation(x, kind="gelu_tanh")
    return nn.gelu_approx(x) if out is None else out


@cache
def _mlx_nn_with_kernels() -> types.ModuleType:
    """A copy of `mlx.nn` whose gelu_approx is the kernel's."""
    return _copy_of(nn, gelu_approx=gelu_approx)


def install(model: nn.Module) -> bool:
    """Give `model`'s modules the matmul, norm, rope and activation kernels; False (nothing
    changed) where they cannot serve. (Its attention kernel: models/cpu/attention.py's
    `install`.)"""
    if unavailable() is not None:
        return False
    taken = rebind.install(model, "mx", mx, _mlx_core_with_kernels())
    taken = fast_exp.install(model, swiglu) or taken
    return rebind.install(model, "nn", nn, _mlx_nn_with_kernels()) or taken


def installed(model: nn.Module) -> bool:
    return unavailable() is None and rebind.installed(model, "mx", _mlx_core_with_kernels())
