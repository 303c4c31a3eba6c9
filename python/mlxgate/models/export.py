"""The embedded model as an mlx-lm model directory with the float32 weights mlxgate serves, for
servers that should compute what it computes (`mlx_lm.server`: `mlxgate bench --spawn mlx_lm`,
benches/export_model.py); the cached conversion (models/gguf.py) keeps the GGUF's 4-bit blocks."""

from __future__ import annotations

import json
from pathlib import Path

from mlxgate.models.tokenizer import ChatTokenizer


def export(out: Path) -> Path:
    """Write the model directory (idempotent: an existing complete export is kept)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxgate.models import load

    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    loaded = load(None, weights="float32", cpu_kernels=False)  # mlx-lm is fastest on float32
    out.mkdir(parents=True, exist_ok=True)
    args = loaded.model.args
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta,
        "rope_traditional": True,  # the GGUF's q/k rows are permuted for interleaved rotary
        "tie_word_embeddings": args.tie_word_embeddings,
        "max_position_embeddings": loaded.context_length,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(loaded.tokenizer, out, loaded.context_length)
    weights = dict(tree_flatten(loaded.model.parameters()))
    # Written last: its presence marks a complete export.
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def write_tokenizer(tok: ChatTokenizer, out: Path, context_length: int) -> None:
    """The tokenizer files of an mlx-lm / Hugging Face model directory."""
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tok.eos_ids)}))
    tok.tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token,
        "pad_token": tok.eos_token,
        "unk_token": tok.eos_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
