"""Random-weight tiny vision-language models built from mlx-vlm's own classes, loaded offline.

Each family is written as a model directory (config.json, model.safetensors, tokenizer files,
preprocessor_config.json) and read back by `mlx_vlm.load`, the loader a served model goes
through, so the processor (image preprocessing, placeholder expansion) is mlx-vlm's own. The
Qwen families use Qwen3's real tokenizer (tests/fixtures/tokenizers/qwen3, which has the
vision tokens); Gemma 3, Mistral 3 and Pixtral use a byte-level tokenizer built here with the
families' image tokens as specials (their real vocabularies are not among the fixtures).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from support.forced import write_tokenizer

if TYPE_CHECKING:
    from mlx_vlm.generate.common import GenerationResult

QWEN_VOCAB = 151936
_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
_QWEN_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# Qwen's processor resizes to a multiple of patch * merge and keeps the pixel count in bounds:
# an 80x64 image becomes 56x56 (16 patches of 14, 4 image tokens) up to 112x112 (16 tokens).
_QWEN_PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "merge_size": 2}

# Byte-level vocabulary (ids 0-255) and the specials the Gemma 3 / Mistral 3 processors need.
_MISTRAL_SPECIALS = [
    "<unk>", "<s>", "</s>", "<pad>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"
]  # fmt: skip
_BYTE_SPECIALS = {
    "gemma3": [
        "<pad>",
        "<bos>",
        "<eos>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
        "<start_of_turn>",
        "<end_of_turn>",
    ],
    "pixtral": _MISTRAL_SPECIALS,
    "mistral3": _MISTRAL_SPECIALS,
}


def _specials_id(family: str, token: str) -> int:
    return 256 + _BYTE_SPECIALS[family].index(token)


def _byte_vocab_size(family: str) -> int:
    return 256 + len(_BYTE_SPECIALS[family])


FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        **_TEXT,
        "vocab_size": QWEN_VOCAB,
        "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            **_QWEN_VISION,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    },
    "qwen3_vl": {
        "model_type": "qwen3_vl",
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "text_config": {
            "model_type": "qwen3_vl",
            **_TEXT,
            "vocab_size": QWEN_VOCAB,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            **_QWEN_VISION,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
    },
    "gemma3": {
        "model_type": "gemma3",
        "image_token_index": _specials_id("gemma3", "<image_soft_token>"),
        "pad_token_id": _specials_id("gemma3", "<pad>"),
        "hidden_size": 64,
        "text_config": {
            "model_type": "gemma3_text",
            **_TEXT,
            "vocab_size": _byte_vocab_size("gemma3"),
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": 4,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    },
    "mistral3": {
        "model_type": "mistral3",
        "image_token_index": _specials_id("mistral3", "[IMG]"),
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "text_config": {
            "model_type": "mistral",
            **_TEXT,
            "vocab_size": _byte_vocab_size("mistral3"),
        },
        "vision_config": {
            "model_type": "pixtral",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
        },
    },
    "pixtral": {
        "model_type": "pixtral",
        "image_token_index": _specials_id("pixtral", "[IMG]"),
        "vision_feature_layer": -1,
        "text_config": {
            "model_type": "mistral",
            **_TEXT,
            "vocab_size": _byte_vocab_size("pixtral"),
        },
        "vision_config": {
            "model_type": "pixtral",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
        },
    },
}

# Each family's prompt with one image, as its chat template writes a user turn.
PROMPTS = {
    "qwen2_5_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "<bos><start_of_turn>user\n<start_of_image>{text}<end_of_turn>\n"
    "<start_of_turn>model\n",
    "mistral3": "<s>[INST][IMG]{text}[/INST]",
}
PROMPTS["qwen3_vl"] = PROMPTS["qwen2_5_vl"]
PROMPTS["pixtral"] = PROMPTS["mistral3"]

_PREPROCESSORS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {**_QWEN_PREPROCESSOR, "patch_size": 14, "temporal_patch_size": 2},
    "qwen3_vl": {**_QWEN_PREPROCESSOR, "patch_size": 16, "temporal_patch_size": 2},
    "gemma3": {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": 56, "width": 56},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": 4,
        "processor_class": "Gemma3Processor",
    },
    "mistral3": {
        "image_processor_type": "PixtralImageProcessor",
        "size": {"longest_edge": 112},
        "patch_size": {"height": 14, "width": 14},
        "processor_class": "Mistral3Processor",
    },
    "pixtral": {
        "image_processor_type": "PixtralImageProcessor",
        "size": {"longest_edge": 112},
        "patch_size": {"height": 14, "width": 14},
        "processor_class": "PixtralProcessor",
    },
}


def _byte_tokenizer(family: str, dest: Path) -> None:
    """A byte-level tokenizer (one id per byte) with the family's specials after the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(b) if 32 < b < 127 else f"<0x{b:02X}>": b for b in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0x00>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = _BYTE_SPECIALS[family]
    tok.add_special_tokens(specials)
    if family == "gemma3":
        extra = {
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        }
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            extra_special_tokens=extra,
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
        )
    fast.save_pretrained(dest)


def _model(config: dict[str, Any]) -> Any:
    """mlx-vlm's model class for `config`, its configs made as `mlx_vlm.utils.load_model` makes
    them."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))
    module, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    return module.Model(model_config)


def write(
    family: str,
    dest: Path,
    seed: int = 0,
    *,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    preprocessor: dict[str, Any] | None = None,
) -> Path:
    """The family's tiny model as a model directory in `dest`; `text`, `vision` and
    `preprocessor` change its language model's config, its vision tower's and its image
    processor's (e.g. a real model's sizes, for benchmarks)."""
    config = json.loads(json.dumps(FAMILIES[family]))
    if text:
        config.update({k: v for k, v in text.items() if k in config})
        if "text_config" in config:
            config["text_config"].update(text)
    if vision:
        config["vision_config"].update(vision)
    mx.random.seed(seed)
    model = _model(config)
    mx.eval(model.parameters())
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    processing = {**_PREPROCESSORS[family], **(preprocessor or {})}
    (dest / "preprocessor_config.json").write_text(json.dumps(processing))
    if family == "gemma3":  # the number of soft tokens an image expands to
        seq = processing.get("image_seq_length", 4)
        (dest / "processor_config.json").write_text(json.dumps({"image_seq_length": seq}))
    if family.startswith("qwen"):
        write_tokenizer("qwen3", dest)
    else:
        _byte_tokenizer(family, dest)
    return dest


@cache
def load(family: str) -> tuple[Any, Any]:
    """(model, processor) as `mlx_vlm.load` reads the family's tiny model directory."""
    from mlx_vlm import load as vlm_load

    with tempfile.TemporaryDirectory() as tmp:
        return vlm_load(str(write(family, Path(tmp) / family)))


def image_token_id(family: str) -> int:
    """The id the family's processor repeats for each of an image's features."""
    config = FAMILIES[family]
    token_id = config.get("image_token_id", config.get("image_token_index"))
    assert token_id is not None, family
    return int(token_id)


def stream_generate(
    model: Any,
    processor: Any,
    prompt: str,
    image: list[Image.Image] | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResult]:
    """mlx-vlm's own `stream_generate` generator, with the images as PIL images: it takes them
    (`mlx_vlm.utils.load_image`) though it declares `image` paths or URLs."""
    from mlx_vlm import stream_generate as generate

    return generate(model, processor, prompt, image=image, **kwargs)  # type: ignore[arg-type]


def token(step: GenerationResult) -> int:
    """The token a generation step produced (mlx-vlm's steps have none only when nothing was
    generated)."""
    assert step.token is not None, step
    return step.token


def logprobs(step: GenerationResult) -> mx.array:
    """A generation step's log-probabilities over the vocabulary: an mx.array, which mlx-vlm
    declares a list of floats."""
    assert step.logprobs is not None, step
    return cast(mx.array, step.logprobs)


def image(kind: int, width: int = 80, height: int = 64) -> Image.Image:
    """A deterministic RGB test image: kind 0 and 1 differ everywhere."""
    y, x = np.mgrid[0:height, 0:width]
    if kind == 0:
        pixels = np.stack([x * 3, y * 4, (x + y) * 2], -1)
    else:
        pixels = np.stack([255 - x * 3, (y * 7) % 256, (x * y) % 256], -1)
    return Image.fromarray((pixels % 256).astype(np.uint8))
