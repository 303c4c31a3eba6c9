"""Converts a llama-family GGUF file, once, into an mlx-lm model directory in the cache.

The directory is what mlx-lm loads: `config.json`, the GGUF's tensors as MLX reads them (its
4- and 8-bit blocks as MLX's affine quantization, groups of 32) under mlx-lm's names, and the
tokenizer transformers builds from the file's metadata (`tokenizer.json`, its config and chat
template). It is keyed by the file's path, size and modification time (and the transformers
version), so a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("mlxgate")

# Part of the cache key: a change to what convert() writes converts every file again.
CONVERSION_VERSION = 1

# GGUF tensor name -> mlx-lm llama parameter name (per block, then global).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def cache_dir() -> Path:
    """Where mlxgate keeps what it makes once: `$MLXGATE_CACHE`, else `$XDG_CACHE_HOME/mlxgate`,
    else `~/.cache/mlxgate`."""
    if own := os.environ.get("MLXGATE_CACHE"):
        return Path(own).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlxgate"


def converted(path: Path) -> Path:
    """The mlx-lm directory of the GGUF file `path`, converted on first use."""
    stat = path.stat()
    # The tokenizer is transformers' conversion: a new transformers converts again too.
    made_by = f"{CONVERSION_VERSION}\0{importlib.metadata.version('transformers')}"
    key = f"{made_by}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    out = cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    log.info("converting %s into an mlx-lm model directory (once): %s", path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed whole: a directory that exists is complete.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        staging.chmod(0o755)  # (mkdtemp's is private)
        convert(path, staging)
        try:
            staging.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def read_metadata(path: Path) -> dict[str, Any]:
    """The file's metadata as plain Python values (llama.cpp's `gguf` reader)."""
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def convert(path: Path, out: Path) -> None:
    """Write the mlx-lm model directory of the llama-architecture GGUF file `path` into `out`."""
    import mlx.core as mx

    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama only)")
    tensors: dict[str, mx.array] = mx.load(str(path))  # type: ignore[assignment]
    weights = {_parameter_name(name): tensor for name, tensor in tensors.items()}
    config = _config(path, meta, weights)
    write_tokenizer(meta, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def _config(path: Path, meta: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    def hp(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    heads = hp("attention.head_count")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hp("embedding_length"),
        "num_hidden_layers": hp("block_count"),
        "intermediate_size": hp("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": hp("attention.head_count_kv", heads),
        "rms_norm_eps": hp("attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": hp("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes q/k rows for interleaved (GPT-J style) rotary.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "max_position_embeddings": int(hp("context_length", 2048)),
    }
    if scaling := _their_rope_scaling(path, hp):
        config["rope_scaling"] = scaling
    if any(name.endswith(".scales") for name in weights):
        # The default; mlx-lm reads each tensor's own bits from its shapes.
        config["quantization"] = {"group_size": 32, "bits": 4}
    return config


def _parameter_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{suffix}"
    base, suffix = parts[0], parts[1]
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _their_rope_scaling(path: Path, hp: Any) -> dict[str, Any] | None:
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


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """The tokenizer files of a Hugging Face model directory, built by transformers from a GGUF
    file's metadata (as `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds it, whose
    own reader needs torch), plus `generation_config.json` with the file's end tokens."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    found = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in keys.items()
            if f"tokenizer.{key}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, settings = found["tokenizer"], found["tokenizer_config"]
    tokens = tokenizer["tokens"]
    # As transformers' get_gguf_tokenizer: llama.cpp adds BOS to a sentencepiece vocabulary
    # that does not say otherwise.
    if tokenizer.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        settings[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra).save_pretrained(out)
    ends = {meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")} - {None}
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(ends)}))
