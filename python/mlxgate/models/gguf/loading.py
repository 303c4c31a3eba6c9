"""What a converted GGUF directory (models/gguf) needs at load beyond what mlx-lm does.

- Q6_K tensors are stored as 8-bit weights in groups of 16. MLX multiplies them through
  `mx.dequantize` alone: `mx.quantize` refuses groups of 16 (and mlx-lm's modules call it to
  make the placeholders their weights replace), and MLX's own CPU `quantized_matmul` gives wrong
  answers for them (mlx 0.31). mlxgate's CPU kernels multiply them; wherever those do not serve
  the model, `widen_groups_of_16` makes the layers float32, as the values are.
- An embedding keeps llama.cpp's float16 scales (half the bytes a tied output head reads each
  step), but its rows, d * q, need float32: `FloatRowsEmbedding`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

SIXTEEN = 16
_quantize_patched = threading.Lock()


class FloatRowsEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose rows come out in float32, whatever its scales' dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(mx.float32),
            biases=biases[x].astype(mx.float32) if biases is not None else None,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


@contextlib.contextmanager
def groups_of_16() -> Iterator[None]:
    """While mlx-lm builds a converted model: `mx.quantize` makes zero placeholders for groups of
    16 (the loaded weights replace them) and is MLX's own for everything else."""
    with _quantize_patched:
        original = mx.quantize

        def quantize(w: mx.array, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group_size", args[0] if args else None)
            bits = kwargs.get("bits", args[1] if len(args) > 1 else None)
            if group != SIXTEEN or bits is None:
                return original(w, *args, **kwargs)
            rows, columns = w.shape
            placeholder = mx.zeros((rows, columns // SIXTEEN), w.dtype)
            return mx.zeros((rows, columns * bits // 32), mx.uint32), placeholder, placeholder

        mx.quantize = quantize
        try:
            yield
        finally:
            mx.quantize = original


def prepare(model: nn.Module, dequantized: bool) -> None:
    """Before a converted model is served: its embeddings give float32 rows; or, where the model
    is to be served dequantized, every scale and bias is float32 first, so that the dequantized
    weights are the file's values."""
    for module in model.modules():
        if dequantized and isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales = module.scales.astype(mx.float32)
            if (biases := module.get("biases")) is not None:
                module.biases = biases.astype(mx.float32)
        elif type(module) is nn.QuantizedEmbedding:
            module.__class__ = FloatRowsEmbedding


def widen_groups_of_16(model: nn.Module) -> int:
    """Make each layer quantized in groups of 16 float32 (for where mlxgate's CPU kernels do not
    multiply the model); returns how many."""
    widened: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        if module.group_size != SIXTEEN:
            continue
        weight = mx.dequantize(
            module.weight, module.scales, module.get("biases"), SIXTEEN, module.bits
        )
        if isinstance(module, nn.QuantizedEmbedding):
            wide: nn.Module = nn.Embedding(*weight.shape)
        else:
            wide = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                wide.bias = module.bias
        wide.weight = weight
        widened.append((name, wide))
    if widened:
        model.update_modules(tree_unflatten(widened))
    return len(widened)
