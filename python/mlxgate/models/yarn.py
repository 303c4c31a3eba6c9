"""YaRN's rope where a model's config asks for what mlx-lm's `YarnRoPE` does not read.

mlx-lm computes YaRN as transformers' `_compute_yarn_parameters` and llama.cpp's `rope_yarn` do
for the keys `factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`
and `mscale_all_dim` (tests/test_yarn.py holds it to the published formulas), but it ignores
two: `attention_factor` (the attention temperature given outright) and `truncate: false` (the
ramp between the untouched and the interpolated dimensions left at its fractional ends, as
gpt-oss was trained). For a config with either, the built model's YaRN ropes get the reference
values here; mlx-lm would need to read both keys in `rope_utils.initialize_rope`.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def needs_reference(scaling: dict[str, Any] | None) -> bool:
    """Whether `scaling` (a config's rope_scaling) is YaRN with a key mlx-lm ignores."""
    if not scaling or (scaling.get("type") or scaling.get("rope_type")) != "yarn":
        return False
    return scaling.get("attention_factor") is not None or scaling.get("truncate") is False


def inverse_frequencies(dims: int, base: float, scaling: dict[str, Any]) -> list[float]:
    """Per rotated pair: the angle per position, blending the model's own frequencies (fast
    pairs) with the interpolated ones (slow pairs) along YaRN's ramp."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(float(scaling.get("beta_fast", 32)))
    high = correction_dim(float(scaling.get("beta_slow", 1)))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    inverse = []
    for pair in range(dims // 2):
        own = base ** (-2 * pair / dims)
        extrapolated = 1 - min(1.0, max(0.0, (pair - low) / (high - low)))
        inverse.append(own / factor * (1 - extrapolated) + own * extrapolated)
    return inverse


def attention_factor(scaling: dict[str, Any]) -> float:
    """How much the rope scales the rotated dimensions of queries and keys."""
    if (given := scaling.get("attention_factor")) is not None:
        return float(given)
    factor = float(scaling["factor"])

    def temperature(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    # mlx-lm's reading (DeepSeek's own code): mscale over mscale_all_dim, each defaulting to 1, 0.
    return temperature(scaling.get("mscale", 1)) / temperature(scaling.get("mscale_all_dim", 0))


def follow_config(model: nn.Module, config: dict[str, Any]) -> int:
    """Give the YaRN ropes of `model`, built from `config` (config.json), the reference values
    where the config's rope_scaling has a key mlx-lm ignores; returns how many it changed."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    scaling = text.get("rope_scaling") or text.get("rope_parameters")
    if not isinstance(scaling, dict) or not needs_reference(scaling):
        return 0
    base = text.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    return follow_reference(model, float(base), scaling)


def follow_reference(model: nn.Module, base: float, scaling: dict[str, Any]) -> int:
    """Give every YaRN rope of `model` the reference frequencies and attention factor for
    `scaling`; returns how many it changed."""
    from mlx_lm.models.rope_utils import YarnRoPE

    changed = 0
    for module in model.modules():
        if isinstance(module, YarnRoPE):
            inverse = mx.array(inverse_frequencies(module.dims, base, scaling), dtype=mx.float32)
            module._freqs = 1 / inverse
            module.mscale = attention_factor(scaling)
            changed += 1
    return changed
