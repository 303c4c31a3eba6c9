"""Random-weight tiny models of every architecture family, built from mlx-lm's own model classes.

Shapes are the smallest each family's code accepts with more than one of everything that is
batched differently (key/value heads, experts, layer kinds), and a sliding window (8 tokens)
short enough for prompts to cross it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, quantize_model

VOCAB = 256
WINDOW = 8

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
_SLIDING = ["sliding_attention", "full_attention"] * 2
_GATED_DELTA: dict[str, Any] = {
    **_MOE,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "shared_expert_intermediate_size": 64,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 2,
}
_MINISTRAL: dict[str, Any] = {
    "model_type": "ministral3",
    "sliding_window": WINDOW,
    "layer_types": _SLIDING,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 4096,
    },
}

# Per architecture: what its config needs beyond the base.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": _MOE,
    "qwen3_next": _GATED_DELTA,
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": _SLIDING,
    },
    "gemma3_text": {"sliding_window": WINDOW, "sliding_window_pattern": 2},
    "glm4_moe": {
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    "deepseek_v3": {
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "rope_scaling": None,
    },
    "ministral3": _MINISTRAL,
    "nemotron_h": {
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*M-",
    },
    "lfm2": {
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "full_attn_idxs": [1, 3],
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "granitemoehybrid": {
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "position_embedding_type": "rope",
    },
    "phi3": {},
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 2},
    # Attention and an SSM side by side in every layer: a CacheList per layer.
    "falcon_h1": {
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "rope_theta": 10000.0,
    },
    "gemma2": {"query_pre_attn_scalar": 16},
    "hunyuan_v1_dense": {"use_qk_norm": True},
}
# Multimodal wrappers: the language model is configured under `text_config`.
_WRAPPERS: dict[str, dict[str, Any]] = {
    "qwen3_5": {**_GATED_DELTA, "model_type": "qwen3_5_text"},
    "qwen3_5_moe": {**_GATED_DELTA, "model_type": "qwen3_5_moe_text"},
    "mistral3": _MINISTRAL,
}

ARCHITECTURES = [*_FAMILIES, *_WRAPPERS]


def config(arch: str) -> dict[str, Any]:
    """The config.json of a tiny `arch` model."""
    if arch in _WRAPPERS:
        text = {**_BASE, **copy.deepcopy(_WRAPPERS[arch])}
        return {"model_type": arch, "text_config": text, "vocab_size": VOCAB}
    return {**_BASE, "model_type": arch, **copy.deepcopy(_FAMILIES[arch])}


def build(arch: str, seed: int = 0) -> nn.Module:
    """A random-weight `arch` model (the same weights for the same seed)."""
    cfg = config(arch)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    mx.eval(model.parameters())
    return model  # type: ignore[no-any-return]


def quantized(model: nn.Module, arch: str, mode: str = "affine") -> nn.Module:
    """`model` with its weights quantized to 4 bits as `mlx_lm.convert -q` does (`mode`:
    "affine", or "mxfp4" as gpt-oss ships)."""
    quantize_model(model, config(arch), group_size=32, bits=4, mode=mode)
    mx.eval(model.parameters())
    return model


def twins(arch: str, quantization: str | None = None) -> tuple[Any, Any]:
    """Two instances with the same weights: one to serve, one for mlx-lm to run alone."""
    served, reference = build(arch), build(arch, seed=1)
    if quantization is not None:
        served = quantized(served, arch, quantization)
        reference = quantized(reference, arch, quantization)
    reference.update(served.parameters())
    mx.eval(reference.parameters())
    return served, reference


def directory(parent: Path, arch: str, **overrides: Any) -> Path:
    """A random-weight `arch` model directory, `parent / arch`, with qwen3's tokenizer files
    (`overrides`: config.json's fields to change; its vocabulary is VOCAB unless given)."""
    from mlx.utils import tree_flatten

    from support.forced import write_tokenizer

    cfg = {**config(arch), **overrides}
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(cfg))
    written = write_tokenizer("qwen3", parent / arch)
    (written / "config.json").write_text(json.dumps(cfg))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(written / "model.safetensors"), weights)  # type: ignore[arg-type]
    return written
