"""GGUF files as llama.cpp writes them, converted by mlxgate: every block type gives back exactly
the values llama.cpp's own `gguf` package decodes, and every architecture loads as the mlx-lm
model it was written from (random-weight tiny models, written the way llama.cpp's converter
names, permutes and offsets their tensors)."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGUFReader,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate import models
from mlxgate.models import embedded, gguf
from mlxgate.models.cpu import kernels
from mlxgate.models.gguf.tensors import AFFINE_BITS
from support.tiny_models import config as tiny_config

# The block types a llama.cpp quantization writes (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0), and what
# mlxgate makes of each: the bits of MLX's affine quantization (in groups of 32; Q6_K's of 16)
# or float32 values.
BLOCK_TYPES = {
    Q.F32: None,
    Q.F16: None,
    Q.BF16: None,
    Q.Q8_0: 8,
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q5_0: 8,
    Q.Q5_1: 8,
    Q.Q4_K: 4,
    Q.Q5_K: 8,
    Q.Q6_K: 8,
}


def blocks(kind: Q, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """A `rows` x `columns` tensor stored as `kind`: random values quantized by the `gguf`
    package where it quantizes that type, else random blocks with finite float16 scales (a few
    of them zero)."""
    values = rng.standard_normal((rows, columns), dtype=np.float32) * 0.05
    if kind == Q.F32:
        return values
    if kind == Q.F16:
        return values.astype(np.float16)
    if kind not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize(values, kind)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, size=(len(raw), 2)) * rng.choice([-1, 1], (len(raw), 2))
    scales[rng.random(len(raw)) < 0.05] = 0
    at = slice(type_size - 2, type_size) if kind == Q.Q6_K else slice(0, 4)
    raw[:, at] = scales.astype(np.float16)[:, : 1 if kind == Q.Q6_K else 2].view(np.uint8)
    return raw.reshape(rows, -1)


def add(writer: GGUFWriter, name: str, data: np.ndarray[Any, Any], kind: Q) -> None:
    if kind in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


@cache
def smollm2_tokenizer() -> dict[str, Any]:
    """The embedded model's vocabulary as GGUF metadata (byte-level BPE), cut to its first 512
    tokens and the merges that make them (merge i makes token 273 + i), which read quickly."""
    fields = GGUFReader(embedded.path()).fields
    meta = {key: fields[key].contents() for key in fields if key.startswith("tokenizer.")}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        meta[key] = meta[key][:512]
    meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"][: 512 - 273]
    return meta


def write_tokenizer(writer: GGUFWriter) -> None:
    meta = smollm2_tokenizer()
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


def write_hparams(writer: GGUFWriter, cfg: dict[str, Any]) -> None:
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])


# (a) Block types.

LAYER = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "cpu_kernels"),
    [*((kind, True) for kind in BLOCK_TYPES), (Q.Q6_K, False)],
    ids=lambda value: value.name if isinstance(value, Q) else "" if value else "no-kernels",
)
def test_each_block_type_loads_as_llama_cpp_decodes_it(
    kind: Q, cpu_kernels: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A llama-architecture file whose every matrix is `kind`: each loaded weight, dequantized
    by MLX, equals `gguf.quants.dequantize` of the stored blocks bit for bit; groups of 16,
    which only mlxgate's kernels multiply, are float32 values without them."""
    monkeypatch.setenv("MLXGATE_CACHE", str(tmp_path / "cache"))
    cfg = {**tiny_config("llama"), **LAYER}
    rng = np.random.default_rng(int(kind))
    path = tmp_path / f"{kind.name}.gguf"
    writer = GGUFWriter(path, "llama")
    write_hparams(writer, cfg)
    write_tokenizer(writer)
    stored: dict[str, np.ndarray[Any, Any]] = {}
    hidden, ffn, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"token_embd": (cfg["vocab_size"], hidden), "output": (cfg["vocab_size"], hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        shapes |= {
            f"blk.{layer}.attn_q": (heads * cfg["head_dim"], hidden),
            f"blk.{layer}.attn_k": (kv, hidden),
            f"blk.{layer}.attn_v": (kv, hidden),
            f"blk.{layer}.attn_output": (hidden, heads * cfg["head_dim"]),
            f"blk.{layer}.ffn_gate": (ffn, hidden),
            f"blk.{layer}.ffn_up": (ffn, hidden),
            f"blk.{layer}.ffn_down": (hidden, ffn),
        }
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, (rows, columns) in shapes.items():
        stored[name] = blocks(kind, rows, columns, rng)
        add(writer, f"{name}.weight", stored[name], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loaded = models.load(str(path), cpu_kernels=cpu_kernels)
    # Each module under the name llama.cpp's own map gives its weight.
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    modules = {names.get_name(n): m for n, m in loaded.model.named_modules() if names.get_name(n)}
    reader = {t.name: t for t in GGUFReader(path).tensors}
    bits = BLOCK_TYPES[kind]
    group = 16 if kind == Q.Q6_K else 32
    if group == 16 and not (cpu_kernels and kernels.unavailable() is None):
        bits = None
    for name in shapes:
        tensor = reader[f"{name}.weight"]
        assert tensor.tensor_type == kind
        want = dequantize(tensor.data, kind).astype(np.float32)
        module = modules[name]
        if bits is None:
            assert module.weight.dtype == mx.float32
            got = np.array(module.weight)
        else:
            assert (module.bits, module.group_size) == (bits, group), name
            # float16 where that holds them exactly (the K-quants' d * sc does not)
            half = kind not in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
            assert module.scales.dtype == (mx.float16 if half else mx.float32), name
            scales, biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
            got = np.array(mx.dequantize(module.weight, scales, biases, group, module.bits))
        np.testing.assert_array_equal(got, want, err_msg=name)
        if name == "token_embd":  # looked up: the rows themselves, in float32
            rows = loaded.model.model.embed_tokens(mx.arange(16))
            assert rows.dtype == mx.float32
            np.testing.assert_array_equal(np.array(rows), want[:16])
    assert AFFINE_BITS.get(kind) == BLOCK_TYPES[kind]


# (b) Architectures, written under the tensor names of llama.cpp's own map (gguf-py's
# TensorNameMap: the Hugging Face names, as mlx-lm's, to the GGUF ones).

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GEMMA3 = {"tie_word_embeddings": True, "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0}
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,  # (the temperature grows every 64 positions)
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
# GGUF architecture -> (mlx-lm model type, its config beyond tiny_models').
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    # Llama 3.1-3.3: the rope scaling stored as per-frequency factors (rope_freqs).
    "llama-llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    # Mistral and Ministral (MistralForCausalLM) are llama to llama.cpp's converter.
    "llama-mistral": ("mistral", {}),
    # Ministral 3: llama's tensors (permuted), YaRN and Llama 4's attention temperature.
    "mistral3": (
        "ministral3",
        {"rope_parameters": MINISTRAL3_ROPE, "layer_types": None},
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    # As Gemma 3 ships: every 6th layer global, which llama.cpp's converter does not write.
    "gemma3": (
        "gemma3_text",
        {**GEMMA3, "num_hidden_layers": 6, "sliding_window_pattern": 6},
    ),
    # A file that states its layers' pattern (`attention.sliding_window_pattern`, per layer).
    "gemma3-swa-pattern": ("gemma3_text", GEMMA3),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),
    # Phi-3.5 / Phi-4 mini: LongRoPE, its factors stored as tensors.
    "phi3-longrope": (
        "phi3",
        {
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 3.0, 7.0],
                "short_factor": [1.0, 1.1, 1.2, 1.5],
            },
            "partial_rotary_factor": 0.5,
        },
    ),
}


def llama_permute(weights: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """llama.cpp's `LlamaModel.permute`: q/k rows reordered for interleaved rotary pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray[Any, Any]:
    """llama.cpp's `LlamaModel.generate_extra_tensors`, as written there."""
    scaling, dim = cfg["rope_scaling"], cfg["head_dim"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def tiny_original(arch: str, **changes: Any) -> tuple[Any, dict[str, Any]]:
    """The random-weight mlx-lm model (seeded) a family's file is written from, and its config
    (tiny_models' with the family's and `changes`)."""
    model_type, extra = FAMILIES[arch]
    family = "llama" if model_type == "mistral" else model_type
    cfg = {**tiny_config(family), **extra, "model_type": model_type, **changes}
    if family == "ministral3":
        cfg.pop("sliding_window")
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    return model_class(args_class.from_dict(cfg)), cfg


def write_as_llama_cpp(model: Any, cfg: dict[str, Any], arch: str, path: Path) -> None:
    arch = arch.split("-")[0]
    names = get_tensor_name_map(
        next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch), cfg["num_hidden_layers"]
    )
    writer = GGUFWriter(path, arch)
    write_hparams(writer, cfg)
    write_tokenizer(writer)
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
        if (pattern := cfg["sliding_window_pattern"]) != 6:  # per layer: sliding or not
            layers = range(cfg["num_hidden_layers"])
            writer.add_sliding_window_pattern([(i + 1) % pattern != 0 for i in layers])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_dimension_count(int(cfg["head_dim"] * cfg["partial_rotary_factor"]))
        writer.add_sliding_window(0)
    if arch == "mistral3":  # Mistral3Model.Ministral3Model.set_gguf_parameters
        rope = cfg["rope_parameters"]
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    if scaling.get("type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.array(scaling[f"{kind}_factor"], np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    parameters: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, array in parameters:
        values = np.array(array.astype(mx.float32))
        stem, suffix = name.rsplit(".", 1)
        gguf_stem = names.get_name(stem)
        assert gguf_stem is not None, f"llama.cpp has no name for {stem}"
        base = gguf_stem.rsplit(".", 1)[-1]
        if arch in ("llama", "mistral3") and base in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads" if base == "attn_q" else "num_key_value_heads"]
            values = llama_permute(values, heads)
        gguf_name = f"{gguf_stem}.{suffix}"
        if arch == "gemma3" and stem.endswith("norm"):
            values = values + np.float32(1)  # Gemma3Model.modify_tensors: norm_shift
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_architecture_loads_as_the_model_it_was_written_from(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXGATE_CACHE", str(tmp_path / "cache"))
    original, cfg = tiny_original(arch)
    # Norm weights away from their initial ones, so that a norm read wrong shows.
    parameters: list[tuple[str, mx.array]] = tree_flatten(original.parameters())  # type: ignore[assignment]
    norms = [(n, mx.random.uniform(0.5, 1.5, p.shape)) for n, p in parameters if "norm." in n]
    original.update(tree_unflatten(norms))
    mx.eval(original.parameters())
    path = tmp_path / f"{arch}.gguf"
    write_as_llama_cpp(original, cfg, arch, path)

    loaded = models.load(str(path), cpu_kernels=False)
    # (Mistral is llama to llama.cpp's converter.)
    model_type = cfg["model_type"]
    assert loaded.model.model_type == {"mistral": "llama"}.get(model_type, model_type)
    # Long enough for the slower rope pairs to turn.
    tokens = mx.array(np.random.default_rng(0).integers(0, cfg["vocab_size"], (1, 256)))
    want = np.array(original(tokens))
    got = np.array(loaded.model(tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'mamba' is not supported \(llama, qwen2, qwen3, gemma3"):
        gguf.convert(path, tmp_path)
