"""What each GGUF architecture is in mlx-lm: its config.json from the file's metadata, its
tensors under mlx-lm's names, and the changes llama.cpp's converter made undone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# GGUF block tensor -> mlx-lm parameter (then per architecture, what differs).
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    block: dict[str, str] = field(default_factory=dict)  # beyond _BLOCK
    # The config's keys beyond the common ones, from the metadata reader `hp`.
    extra: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] = lambda hp, c: {}
    # llama.cpp's converter adds 1 to Gemma's norm weights (its RMSNorm multiplies by w, Gemma's
    # by 1 + w, as mlx-lm's does): taken off again.
    norm_shift: float = 0.0
    # Interleaved rotary pairs: llama.cpp's converter permutes llama's q/k rows for them.
    rope_traditional: bool = False
    # The same permutation undone, for an mlx-lm model whose rope is always half-split.
    unpermute: bool = False

    def parameter(self, gguf_name: str) -> str:
        parts = gguf_name.split(".")
        if parts[0] == "blk":
            layer, base, suffix = parts[1], parts[2], parts[3]
            name = self.block.get(base) or _BLOCK.get(base)
            if name is None:
                raise ValueError(f"GGUF tensor {gguf_name!r} is not known for {self.model_type}")
            return f"model.layers.{layer}.{name}.{suffix}"
        base, suffix = parts[0], parts[1]
        if base not in _GLOBAL:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not known for {self.model_type}")
        return f"{_GLOBAL[base]}.{suffix}"


def _gemma3(hp: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's constants for Gemma 3 where the file has none: every 6th layer global, the
    # sliding ones at rope base 10,000, queries scaled by the head size (hidden / heads for 27B,
    # which llama.cpp knows by its 62 layers).
    pattern = hp("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: sliding or not
        pattern = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
    if hp("attention.sliding_window") is None:  # written only for a model that slides
        pattern = 1
    head_dim = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    return {
        "sliding_window": hp("attention.sliding_window", 512),
        "sliding_window_pattern": int(pattern),
        "rope_local_base_freq": hp("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": head_dim,
    }


def _phi3(hp: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    rotary = hp("rope.dimension_count", config["head_dim"])
    return {
        "partial_rotary_factor": rotary / config["head_dim"],
        "original_max_position_embeddings": int(
            hp("rope.scaling.original_context_length") or config["max_position_embeddings"]
        ),
    }


def _mistral3(hp: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    # Ministral 3: YaRN and Llama 4's attention temperature, as mlx-lm's `rope_parameters`.
    # llama.cpp keeps one YaRN log multiplier (the config's mscale_all_dim; Ministral 3 ships
    # mscale = mscale_all_dim = 1).
    log_multiplier = hp("rope.scaling.yarn_log_multiplier", 1.0)
    return {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": config["rope_theta"],
            "factor": float(hp("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                hp("rope.scaling.original_context_length") or config["max_position_embeddings"]
            ),
            "beta_fast": hp("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": hp("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": log_multiplier,
            "mscale_all_dim": log_multiplier,
            "llama_4_scaling_beta": hp("attention.temperature_scale", 0.0),
        },
    }


ARCHITECTURES = {
    "llama": Architecture("llama", rope_traditional=True),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "gemma3": Architecture(
        "gemma3_text",
        block={
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        extra=_gemma3,
        norm_shift=1.0,
    ),
    "mistral3": Architecture("ministral3", extra=_mistral3, unpermute=True),
    "phi3": Architecture(
        "phi3",
        block={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        extra=_phi3,
    ),
}


ROPE_TENSORS = ("rope_freqs.", "rope_factors_long.", "rope_factors_short.")


def config(
    path: Path,
    meta: dict[str, Any],
    arch: Architecture,
    weights: dict[str, Any],
    ropes: dict[str, np.ndarray[Any, Any]],
) -> dict[str, Any]:
    """The config.json of the model in `path`, from its metadata (and its rope factors)."""
    prefix = meta["general.architecture"]

    def hp(key: str, default: Any = None) -> Any:
        return meta.get(f"{prefix}.{key}", default)

    heads = hp("attention.head_count")
    hidden = hp("embedding_length")
    common: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": hp("block_count"),
        "intermediate_size": hp("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": hp("attention.head_count_kv", heads),
        "head_dim": hp("attention.key_length", hidden // heads),
        "rms_norm_eps": hp("attention.layer_norm_rms_epsilon", 1e-5),
        # The embedding's rows (a vocabulary may list more tokens than the model has rows).
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "rope_theta": hp("rope.freq_base", 10000.0),
        "rope_traditional": arch.rope_traditional,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "max_position_embeddings": int(hp("context_length", 2048)),
    }
    extra = arch.extra(hp, common)
    if "rope_parameters" not in extra and (scaling := _their_rope_scaling(path, hp)):
        common["rope_scaling"] = scaling
    common.update(extra)
    if "rope_freqs.weight" in ropes:
        dims = hp("rope.dimension_count", common["head_dim"])
        found = _llama3_scaling(ropes["rope_freqs.weight"], common["rope_theta"], dims)
        if found is None:
            raise ValueError(
                f"{path.name}: its rope frequency factors (rope_freqs) are not Llama 3's scaling"
            )
        if found["factor"] != 1.0:
            common["rope_scaling"] = found
    if "rope_factors_long.weight" in ropes:
        common["rope_scaling"] = {
            "type": "longrope",
            "long_factor": ropes["rope_factors_long.weight"].tolist(),
            "short_factor": ropes["rope_factors_short.weight"].tolist(),
        }
    if any(name.endswith(".scales") for name in weights):
        # The default; mlx-lm reads each tensor's own bits and group from its shapes.
        common["quantization"] = {"group_size": 32, "bits": 4}
    return common


def _their_rope_scaling(path: Path, hp: Callable[..., Any]) -> dict[str, Any] | None:
    """The rope scaling a GGUF file declares (llama.cpp's `rope.scaling.*` keys)."""
    kind = hp("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path.name}: rope scaling {kind!r} is not supported (linear, yarn)")
    original = hp("rope.scaling.original_context_length") or hp("context_length")
    return {
        "type": kind,
        "factor": float(hp("rope.scaling.factor")),
        "original_max_position_embeddings": int(original),
    }


def _llama3_scaling(factors: np.ndarray[Any, Any], base: float, dims: int) -> dict[str, Any] | None:
    """The Llama 3 rope scaling whose per-frequency factors llama.cpp's converter stored as
    `rope_freqs` (LlamaModel.generate_extra_tensors), among the settings Llama 3.1-3.3 ship."""
    factor = float(factors.max())
    for low, high, original in ((1.0, 4.0, 8192),):
        wavelengths = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
        smooth = (original / wavelengths - low) / (high - low)
        want = np.where(
            wavelengths < original / high,
            1.0,
            np.where(wavelengths > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    return None


def unshift(arch: Architecture, name: str, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A norm weight as mlx-lm's architecture applies it."""
    if arch.norm_shift and name.endswith("norm.weight"):
        return values - np.float32(arch.norm_shift)
    return values


def unpermute(
    arch: Architecture, name: str, rows: np.ndarray[Any, Any], meta: dict[str, Any]
) -> np.ndarray[Any, Any]:
    """q/k rows (of a weight, or of its scales and biases) in the order they had before
    llama.cpp's `LlamaModel.permute`: per head, the halves of the rotary pairs apart again."""
    if not arch.unpermute or not name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
        return rows
    prefix = meta["general.architecture"]
    heads = meta[f"{prefix}.attention.head_count"]
    if name.endswith("k_proj"):
        heads = meta.get(f"{prefix}.attention.head_count_kv", heads)
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
