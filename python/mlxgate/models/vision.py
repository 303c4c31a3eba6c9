"""Vision-language models through mlx-vlm: detected from their config, loaded by mlx-vlm with how
their prompts take images (`ImageTokens`: the processor, the placeholder, the image token), and
run by the engine through `VisionAdapter`.

The API side (api/vision_prompts.py, on a worker thread) turns each image mark of a rendered
prompt into the family's placeholder, lets the processor expand it into the image's tokens and
make its pixel values, and finds each image's span of tokens. The engine side
(`VisionAdapter`, on the engine thread) runs the vision tower once per prompt, as a step of its
prefill, and then feeds the language model chunk by chunk with that prompt's embeddings (and,
for Qwen's 3-D rope, its positions), exactly as mlx-vlm's own generation does in one go.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlxgate.models.adapter import ModelAdapter, _make_stoppable, _Stopped
from mlxgate.models.rope_switch import ScaledRows
from mlxgate.models.tokenizer import ChatTokenizer

# What each family's chat template writes for an image, where the template cannot be asked.
_PLACEHOLDERS = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "mistral3": "[IMG]",
    "pixtral": "[IMG]",
}


def vision_config(path: Path) -> dict[str, Any] | None:
    """The model directory's config if mlx-vlm has its architecture and it has a vision tower;
    else None (a text model: mlx-lm's)."""
    config_file = path / "config.json"
    if not config_file.exists():
        return None
    config: dict[str, Any] = json.loads(config_file.read_text())
    if "vision_config" not in config:
        return None
    from mlx_vlm.utils import get_model_and_args

    try:
        get_model_and_args(config=dict(config))
    except Exception:  # mlx-vlm has no such model type
        return None
    return config


def load(
    path: Path, context_length: int | None
) -> tuple[nn.Module, ChatTokenizer, ImageTokens, int]:
    """mlx-vlm's model from `path`; the chat tokenizer (the processor's chat template, which
    knows images); how its prompts take images (the processor with it); and the context served
    (the model's own unless less is asked: its rope is not scaled)."""
    from mlx_vlm.utils import load as vlm_load

    config = vision_config(path)
    assert config is not None
    model, processor = vlm_load(str(path))
    tokenizer = ChatTokenizer.from_pretrained_dir(path)
    template = getattr(processor, "chat_template", None)
    if isinstance(template, str) and template:
        tokenizer.chat_template = template
    text = config.get("text_config") or config
    native = int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 0)
    if context_length is not None and native and context_length > native:
        raise ValueError(
            f"--context-length {context_length}: this vision model's own context is {native} "
            "tokens, and its rope is not scaled past it"
        )
    served = context_length or native or 4096
    return model, tokenizer, image_tokens(config, processor, tokenizer), served


@dataclass(frozen=True)
class ImageTokens:
    """How one vision model's prompts take images: its processor, the placeholder its chat
    template writes for an image, the token its processor repeats for an image's features, and
    the tokens that stand between the rows of one image's placeholders (Pixtral's row breaks).
    (api/vision_prompts.py makes a prompt's images into tokens with it.)"""

    model_type: str
    processor: Any
    placeholder: str
    image_token: int
    row_breaks: frozenset[int]

    def describe(self) -> str:
        return f"text, image (placeholder {self.placeholder!r})"


def image_tokens(config: dict[str, Any], processor: Any, tokenizer: ChatTokenizer) -> ImageTokens:
    """What the model's config, processor and chat template say about its images."""
    model_type: str = config["model_type"]
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        text = config.get("text_config") or {}
        token = text.get("image_token_id", text.get("image_token_index"))
    if token is None:
        raise ValueError(f"{model_type}: the config names no image token")
    breaks = [getattr(processor, "image_break_token", None)]
    vocab = tokenizer.tokenizer
    row_breaks = frozenset(i for t in breaks if t and (i := vocab.token_to_id(t)) is not None)
    placeholder = _placeholder(model_type, tokenizer)
    return ImageTokens(model_type, processor, placeholder, int(token), row_breaks)


def _placeholder(model_type: str, tokenizer: ChatTokenizer) -> str:
    """What the chat template writes for an image (asked of the template; else the family's)."""
    content = [
        {"type": "text", "text": "MLXGATE_BEFORE"},
        {"type": "image"},
        {"type": "text", "text": "MLXGATE_AFTER"},
    ]
    try:
        text = tokenizer.render([{"role": "user", "content": content}])
        between = text[text.index("MLXGATE_BEFORE") + 14 : text.index("MLXGATE_AFTER")]
    except Exception:  # a template that takes text only, or refuses the probe
        between = ""
    if between.strip():
        return between.strip()
    if model_type in _PLACEHOLDERS:
        return _PLACEHOLDERS[model_type]
    raise ValueError(f"{model_type}: cannot tell how its chat template marks an image")


@dataclass
class Features:
    """What a prompt with images feeds the language model, per position (the vision tower's
    output scattered over the image tokens; Qwen's 3-D positions; Qwen3-VL's deepstack)."""

    embeddings: mx.array | None  # [1, n, hidden]; None: the token ids (no image left to feed)
    positions: mx.array | None  # [3, 1, n] (M-RoPE families)
    rope_delta: int  # positions after the last image run behind token indices by this
    visual: np.ndarray | None = None  # [n] bool: image positions (deepstack)
    deepstack: list[mx.array] | None = None  # per layer, [image positions, hidden]

    def chunk(self, start: int, end: int) -> dict[str, Any]:
        """The language model's inputs for positions [start, end)."""
        out: dict[str, Any] = {}
        if self.embeddings is not None:
            out["inputs_embeds"] = self.embeddings[:, start:end]
        if self.positions is not None:
            out["position_ids"] = self.positions[..., start:end]
        if self.visual is not None and self.deepstack is not None:
            window = self.visual[start:end]
            if window.any():
                first = int(self.visual[:start].sum())
                rows = mx.arange(first, first + int(window.sum()))
                out["visual_pos_masks"] = mx.array(window[None])
                out["deepstack_visual_embeds"] = [layer[rows] for layer in self.deepstack]
        return out


class VisionAdapter(ModelAdapter):
    """What the engine needs from an mlx-vlm model: its language model batched as mlx-lm's are
    (mlx-lm's caches drop in: the attention code only updates and reads them), the vision tower
    run on a prompt's images (`features`), and per-row rope offsets for Qwen's M-RoPE."""

    def __init__(self, model: nn.Module, kv_bits: int = 0, kv_group_size: int = 64) -> None:
        super().__init__(model, kv_bits, kv_group_size)
        # (As the base does for modules' arrays: those of helper objects, e.g. Pixtral's
        # rotary embedding, are computed here too, not first on the engine's thread.)
        mx.eval(
            [
                value
                for module in model.modules()
                for helper in vars(module).values()
                if not isinstance(helper, nn.Module) and hasattr(helper, "__dict__")
                for value in vars(helper).values()
                if isinstance(value, mx.array)
            ]
        )
        self.language_model = model.language_model
        self.m_rope = hasattr(self.language_model, "get_rope_index")
        tower = getattr(model, "vision_tower", None)
        parts = _tower_parts(tower) if tower is not None else []
        self._tower_check = _make_stoppable(parts) if parts else None

    @property
    def per_row_positions(self) -> bool:
        return self.m_rope

    @property
    def banded_attention(self) -> bool:
        """One band: the kernels' attention serves mlx-vlm's layers, but its models' masks are
        not held band by band against mlx-vlm by any test yet."""
        return False

    def make_cache(self) -> list[Any]:
        made = getattr(self.language_model, "make_cache", None)
        own = made() if made is not None else [None] * len(self.layers)
        caches: list[Any] = []
        for cache in own:
            kind = type(cache).__name__
            if cache is None or kind == "KVCache":
                caches.append(
                    QuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
                    if self.kv_bits
                    else KVCache()
                )
            elif kind == "RotatingKVCache":
                caches.append(RotatingKVCache(max_size=cache.max_size, keep=cache.keep))
            else:
                raise ValueError(f"the engine cannot batch this vision model's {kind} layers")
        return caches

    def check_quantized_kv(self) -> str:
        return "quantized keys/values in every full-attention layer"

    def features(
        self,
        ids: list[int],
        images: dict[str, Any],
        should_stop: Callable[[], bool],
        turn: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> Features | None:
        """The whole prompt's (`ids`) inputs, the vision tower run on its images (`images`: the
        processor's outputs for them, numpy arrays); None if
        `should_stop` said so between two of the tower's parts. Every array evaluated: the
        engine's thread reads them (engine/vision_jobs.py runs this on a thread of its own).
        Each part of the tower (`_tower_parts`) is evaluated within a `turn`."""
        inputs = {k: mx.array(v) for k, v in images.items()}
        pixels = inputs.pop("pixel_values", None)
        tokens = mx.array(ids)[None]
        if self._tower_check is not None:
            self._tower_check.should_stop = should_stop
            self._tower_check.evaluating = turn
        try:
            out = self.model.get_input_embeddings(
                tokens, pixels, mask=mx.ones(tokens.shape, dtype=mx.int32), **inputs
            )
            deltas = getattr(out, "rope_deltas", None)
            visual = getattr(out, "visual_pos_masks", None)
            features = Features(
                out.inputs_embeds,
                getattr(out, "position_ids", None) if self.m_rope else None,
                int(np.array(deltas).reshape(-1)[0]) if deltas is not None and self.m_rope else 0,
                np.array(visual).reshape(-1) if visual is not None else None,
                getattr(out, "deepstack_visual_embeds", None),
            )
            with turn():
                mx.eval([features.embeddings, features.positions, features.deepstack])
        except _Stopped:
            return None
        finally:
            if self._tower_check is not None:
                self._tower_check.should_stop = None
                self._tower_check.evaluating = contextlib.nullcontext
        return features

    def positions(self, ids: list[int], images: dict[str, Any]) -> Features:
        """The prompt's inputs where its images need not be encoded (they are all in its cached
        prefix): token ids, and for M-RoPE the positions its images' grids make."""
        if not self.m_rope:
            return Features(None, None, 0)
        tokens = mx.array(ids)[None]
        positions, deltas = self.language_model.get_rope_index(
            tokens,
            mx.array(images["image_grid_thw"]),
            None,
            mx.ones(tokens.shape, dtype=mx.int32),
        )
        return Features(None, positions, int(np.array(deltas).reshape(-1)[0]))

    def _backbone_inputs(
        self, tokens: mx.array, caches: Sequence[Any], inputs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A chunk's embeddings and positions (`Features.chunk`) for a prompt with images; a
        text-only row's M-RoPE positions are its plain ones."""
        inputs = dict(inputs or {})
        if self.m_rope and "position_ids" not in inputs:
            inputs["position_ids"] = self._positions(caches, tokens.shape, None)
        return inputs

    def decode(
        self,
        inputs: mx.array,
        caches: Sequence[Any],
        scaled: ScaledRows = True,
        rope_deltas: np.ndarray | None = None,
    ) -> mx.array:
        return self.verify(inputs[:, None], caches, scaled, rope_deltas)[:, -1, :]

    def verify(
        self,
        inputs: mx.array,
        caches: Sequence[Any],
        scaled: ScaledRows = True,
        rope_deltas: np.ndarray | None = None,
    ) -> mx.array:
        extra = {}
        if self.m_rope:
            extra["position_ids"] = self._positions(caches, inputs.shape, rope_deltas)
        logits: mx.array = self.language_model(inputs, cache=caches, **extra).logits
        return logits

    def _positions(
        self, caches: Sequence[Any], shape: tuple[int, ...], deltas: np.ndarray | None
    ) -> mx.array:
        """M-RoPE positions [3, rows, n] for `n` new tokens a row: its cache's length on, moved
        by the row's rope delta (0 for a text-only row)."""
        rows, n = shape
        offset = caches[0].offset
        start = offset[:, None] if isinstance(offset, mx.array) else mx.full((rows, 1), offset)
        if deltas is not None:
            start = start + mx.array(deltas.reshape(rows, 1).astype(np.int32))
        positions = start + mx.arange(n)[None]
        return mx.broadcast_to(positions[None], (3, rows, n))


def _tower_parts(tower: nn.Module) -> list[nn.Module]:
    """Where the tower's computation is cut, for turns with the engine's steps and for cancels:
    each block's attention and MLP (its parts holding an eighth of its weights or more), or the
    whole block. (Gemma 3's SigLIP blocks take about 4 s each here: half a block is half the
    wait for the decoding streams.)"""
    parts: list[nn.Module] = []
    for block in _vision_blocks(tower):
        weights = _size(block)
        children = [m for m in block.children().values() if isinstance(m, nn.Module)]
        parts.extend([m for m in children if 8 * _size(m) >= weights] or [block])
    return parts


def _size(module: nn.Module) -> int:
    weights: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
    return sum(array.size for _, array in weights)


def _vision_blocks(tower: nn.Module) -> list[nn.Module]:
    """The vision tower's transformer blocks: its longest `blocks` or `layers` list (Qwen's
    `blocks`, SigLIP's and Pixtral's `layers`)."""
    best: list[nn.Module] = []
    for _, module in tower.named_modules():
        for name in ("blocks", "layers"):
            value = getattr(module, name, None)
            if isinstance(value, list) and len(value) > len(best):
                best = value
    return best
