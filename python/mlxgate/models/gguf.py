"""Loads a llama-family GGUF into mlx-lm's llama model, the tokenizer rebuilt from its metadata."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tqdm import tqdm

from mlxgate.models import context
from mlxgate.models.context import ServedContext
from mlxgate.models.tokenizer import DEFAULT_CHATML_TEMPLATE, ChatTokenizer, VocabKind

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

# llama.cpp pre-tokenizer names -> the split regex used before byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_CONTROL = 3


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _parameter_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{suffix}"
    base, suffix = parts[0], parts[1]
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _dequantized(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Dequantize GGUF block-quantized tensors (weight/scales/biases triples, groups of 32)."""
    out: dict[str, mx.array] = {}
    names = [n for n in weights if not n.endswith((".scales", ".biases"))]
    for name in tqdm(names, desc="loading weights", unit="tensor", leave=False):
        tensor = weights[name]
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in weights:
            scales, biases = weights[f"{stem}.scales"], weights[f"{stem}.biases"]
            bits = tensor.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 values
            tensor = mx.dequantize(tensor, scales, biases, group_size=32, bits=bits)
        out[_parameter_name(name)] = tensor.astype(dtype)
        mx.eval(out[_parameter_name(name)])
    return out


def _tokenizer(meta: dict[str, Any]) -> ChatTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types = meta["tokenizer.ggml.token_type"].tolist()
    kind = meta["tokenizer.ggml.model"]
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tokenizer = Tokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False
            )
        )
        pre = meta.get("tokenizer.ggml.pre", "default")
        split = _LLAMA3_SPLIT if pre in ("llama-bpe", "llama3") else _GPT2_SPLIT
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(split), behavior="isolated")
        ]
        if pre in ("smollm", "starcoder"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tokenizer.decoder = decoders.ByteLevel()
        vocab_kind: VocabKind = "byte_level"
    elif kind == "llama":
        scores = meta["tokenizer.ggml.scores"].tolist()
        unk = _scalar(meta, "tokenizer.ggml.unknown_token_id", 0)
        tokenizer = Tokenizer(
            models.Unigram(list(zip(tokens, scores, strict=True)), unk_id=unk, byte_fallback=True)
        )
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        vocab_kind = "sentencepiece"
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    control = [i for i, t in enumerate(token_types) if t == GGUF_TOKEN_CONTROL]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in control]
    )
    bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
    eos_id = _scalar(meta, "tokenizer.ggml.eos_token_id")
    eos_ids = {eos_id}
    if (eot := _scalar(meta, "tokenizer.ggml.eot_token_id")) is not None:
        eos_ids.add(eot)
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    return ChatTokenizer(
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template") or DEFAULT_CHATML_TEMPLATE,
        vocab_kind=vocab_kind,
        eos_ids=frozenset(eos_ids),
        bos_token=tokens[bos_id] if bos_id is not None and add_bos else "",
        eos_token=tokens[eos_id],
        special_ids=frozenset(control),
    )


def load_gguf(
    path: Path,
    dtype: mx.Dtype = mx.float32,
    context_length: int | None = None,
    rope_scaling: str = "yarn",
) -> tuple[nn.Module, ChatTokenizer, ServedContext]:
    """Return (model, tokenizer, served context) for a llama-architecture GGUF file;
    `context_length` (None: the file's own) past the file's own is reached by `rope_scaling`."""
    loaded: Any = mx.load(str(path), return_metadata=True)
    weights: dict[str, mx.array] = loaded[0]
    meta: dict[str, Any] = loaded[1]
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama only)")

    def hp(key: str, default: Any = None) -> Any:
        return _scalar(meta, f"llama.{key}", default)

    theirs = _their_rope_scaling(path, hp)
    native = context.covered(int(hp("context_length", 2048)), theirs)
    their_text = context.describe_scaling(theirs) if theirs else None
    served = context.choose("llama", native, context_length, rope_scaling, their_text)
    heads = hp("attention.head_count")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hp("embedding_length"),
        num_hidden_layers=hp("block_count"),
        intermediate_size=hp("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=hp("attention.head_count_kv", heads),
        rms_norm_eps=hp("attention.layer_norm_rms_epsilon", 1e-5),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=hp("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes q/k rows for interleaved (GPT-J style) rotary.
        rope_traditional=True,
        rope_scaling=served.rope_scaling() or theirs,
        tie_word_embeddings="output.weight" not in weights,
        max_position_embeddings=hp("context_length"),
    )
    model = llama.Model(args)
    context.check_scaled(model, {"model_type": "llama"}, served)
    if served.scaling is not None:  # its own rope too, for what fits the file's own context
        served = context.switch_rope(model, llama.Model(replace(args, rope_scaling=theirs)), served)
    model.load_weights(list(_dequantized(weights, dtype).items()), strict=True)
    model.eval()
    return model, _tokenizer(meta), served


def _their_rope_scaling(path: Path, hp: Callable[[str], Any]) -> dict[str, Any] | None:
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
