"""Making a loaded model run fast on an x86 CPU, on that model instance alone (never on MLX or
mlx-lm for the process): `install_kernels` is the one entry point.

- `rebind.py`: puts mlxgate's function in place of a global an mlx-lm module calls, on one
  model instance's modules (a subclass per module class whose methods see the replacement).
- `attention.py`: the one place that decides which attention the model's layers run (the
  attention kernel, attention in MLX ops without MLX's `exp`, or mlx-lm's own), band by band
  over a banded cache.
- `fast_exp.py`: `exp` without MLX's scalar one, and the SwiGLU activation built on it.
- `offset_norms.py`: Gemma's norms, which scale by 1 + weight, with that sum made once.
- `kernels.py`: the Python side of the `mlxgate-kernels` package (kernels/): whether its C++
  kernels serve on this machine, and its quantized matmuls, RMSNorm, RoPE and gated MLP
  activations on the model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxgate.models.cpu import attention, fast_exp, kernels, offset_norms


def install_kernels(model: nn.Module, native: bool = True) -> str:
    """Put mlxgate's CPU kernels in place of mlx-lm's in `model` (this instance only): the
    attention and activation written in MLX ops, and, with `native`, the compiled ones
    (models/cpu/kernels.py) where this machine runs them. Says what runs the model's matmuls,
    norms and ropes.

    Before a `ModelAdapter` wraps the layers: a wrapped layer's class no longer shows the
    globals its own `__call__` uses (mlx-lm's layers leave those calls to their submodules).
    """
    attention.install(model, kernel=native)
    offset_norms.install(model)
    if native and mx.default_device() == mx.cpu:
        kernels.install(model)  # its SwiGLU first: fast_exp's serves where it does not
    fast_exp.install(model)
    if not native:
        return "MLX's own (--no-cpu-kernels)"
    if mx.default_device() != mx.cpu:
        return f"MLX's own ({mx.default_device()})"
    return kernels.describe()
