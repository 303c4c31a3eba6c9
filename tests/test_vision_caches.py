"""mlx-lm's cache classes, the ones the engine batches, in mlx-vlm's language models (issue 36).

mlx-vlm's models make their own copies of mlx-lm's caches (`mlx_vlm.models.cache`); these
tests hold that mlx-lm's `KVCache` / `RotatingKVCache` and their batched forms give the same
logits in their place, and that rows prefilled alone (each with its own image and, for the
Qwen families, its own rope offset) decode together as they would alone.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache

from support import tiny_vlms

FAMILIES = sorted(tiny_vlms.FAMILIES)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _language_model(family: str) -> Any:
    return tiny_vlms.load(family)[0].language_model


def _own_cache(family: str) -> list[Any]:
    from mlx_vlm.models.cache import make_prompt_cache

    return make_prompt_cache(_language_model(family))


def _mlx_lm_cache(own: list[Any]) -> list[Any]:
    """The mlx-lm cache of each kind mlx-vlm's model made."""
    out: list[Any] = []
    for layer in own:
        name = type(layer).__name__
        if name == "KVCache":
            out.append(lm_cache.KVCache())
        elif name == "RotatingKVCache":
            out.append(lm_cache.RotatingKVCache(max_size=layer.max_size, keep=layer.keep))
        else:
            raise TypeError(f"no mlx-lm cache for {name}")
    return out


def _prefill(family: str, cache: list[Any], kind: int, text: str) -> tuple[mx.array, Any]:
    """The prompt with one image prefilled into `cache`: the last position's logits and the
    row's rope offset (Qwen's M-RoPE: positions after an image run behind token indices)."""
    from mlx_vlm.utils import prepare_inputs

    model, processor = tiny_vlms.load(family)
    lm = model.language_model
    size = (80, 64) if kind == 0 else (120, 100)
    prompt = tiny_vlms.PROMPTS[family].format(text=text)
    inputs = prepare_inputs(processor, images=[tiny_vlms.image(kind, *size)], prompts=[prompt])
    ids = inputs.pop("input_ids")
    pixels = inputs.pop("pixel_values")
    mask = inputs.pop("attention_mask")
    features = model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
    extra = {
        k: v
        for k, v in features.to_dict().items()
        if v is not None and k not in ("inputs_embeds", "attention_mask_4d")
    }
    for state in ("_position_ids", "_rope_deltas"):  # Qwen keeps the last prompt's positions
        if hasattr(lm, state):
            setattr(lm, state, None)
    out = lm(ids, inputs_embeds=features.inputs_embeds, cache=cache, **inputs, **extra)
    return out.logits[:, -1], features.rope_deltas


def _decode(family: str, cache: list[Any], tokens: mx.array, rope_deltas: Any) -> np.ndarray:
    lm = _language_model(family)
    kwargs = {}
    if rope_deltas is not None:
        kwargs["rope_deltas"] = rope_deltas
    logits = lm(tokens, cache=cache, **kwargs).logits[:, -1]
    return np.array(logits.astype(mx.float32))


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_caches_give_mlx_vlm_logits(family: str) -> None:
    own = _own_cache(family)
    theirs = _mlx_lm_cache(own)
    first_own, deltas = _prefill(family, own, 0, "Describe the image.")
    first_theirs, _ = _prefill(family, theirs, 0, "Describe the image.")
    assert np.array_equal(np.array(first_own), np.array(first_theirs))
    token = mx.argmax(first_own, axis=-1)[:, None]
    assert np.array_equal(
        _decode(family, own, token, deltas), _decode(family, theirs, token, deltas)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_different_images_decode_together_as_alone(family: str) -> None:
    rows = []
    for kind, text in ((0, "Hi"), (1, "Describe the picture in detail, please.")):
        cache = _mlx_lm_cache(_own_cache(family))
        logits, deltas = _prefill(family, cache, kind, text)
        rows.append((cache, mx.argmax(logits, axis=-1)[:, None], deltas))
    alone = [_decode(family, copy.deepcopy(c), t, d) for c, t, d in rows]
    batch = [
        (
            lm_cache.BatchKVCache
            if isinstance(layers[0], lm_cache.KVCache)
            else lm_cache.BatchRotatingKVCache
        ).merge(list(layers))
        for layers in zip(*(c for c, _, _ in rows), strict=True)
    ]
    tokens = mx.concatenate([t for _, t, _ in rows])
    deltas = None
    if rows[0][2] is not None:
        deltas = mx.concatenate([d.reshape(1, 1) for _, _, d in rows])
    together = _decode(family, batch, tokens, deltas)
    for i, row in enumerate(alone):
        assert np.array_equal(together[i], row[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_through_the_image_matches_mlx_vlm(family: str) -> None:
    """The engine's way: the image's features computed once, then the prompt prefilled a few
    tokens at a time into mlx-lm caches (chunk boundaries inside the image's span), each chunk
    fed its slice of the embeddings and of Qwen's 3-D positions. The last position's
    log-probabilities are mlx-vlm's own generation's first step."""
    from mlx_vlm.utils import prepare_inputs

    model, processor = tiny_vlms.load(family)
    lm = model.language_model
    prompt = tiny_vlms.PROMPTS[family].format(text="Describe the image.")
    image = tiny_vlms.image(0)
    first = next(
        iter(
            tiny_vlms.stream_generate(
                model, processor, prompt, image=[image], max_tokens=1, temperature=0
            )
        )
    )
    inputs = prepare_inputs(processor, images=[image], prompts=[prompt])
    ids = inputs.pop("input_ids")
    pixels = inputs.pop("pixel_values")
    mask = inputs.pop("attention_mask")
    features = model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
    extra = {
        k: v
        for k, v in features.to_dict().items()
        if v is not None and k not in ("inputs_embeds", "attention_mask_4d", "position_ids")
    }
    positions = features.position_ids
    cache = _mlx_lm_cache(_own_cache(family))
    n = ids.shape[1]
    span = np.flatnonzero(np.array(ids[0]) == tiny_vlms.image_token_id(family))
    assert span[0] % 3 != 0 and len(span) > 3  # a chunk starts inside the image
    for start in range(0, n, 3):
        end = min(start + 3, n)
        chunk: dict[str, Any] = dict(extra)
        if positions is not None:
            chunk["position_ids"] = positions[..., start:end]
        out = lm(
            ids[:, start:end],
            inputs_embeds=features.inputs_embeds[:, start:end],
            cache=cache,
            **chunk,
        )
    logits = out.logits[0, -1].astype(mx.float32)
    ours = np.array(logits - mx.logsumexp(logits))
    theirs = np.array(tiny_vlms.logprobs(first).astype(mx.float32)).ravel()
    assert int(ours.argmax()) == first.token
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def _features(family: str, kind: int, text: str) -> tuple[mx.array, Any]:
    from mlx_vlm.utils import prepare_inputs

    model, processor = tiny_vlms.load(family)
    size = (80, 64) if kind == 0 else (120, 100)
    prompt = tiny_vlms.PROMPTS[family].format(text=text)
    inputs = prepare_inputs(processor, images=[tiny_vlms.image(kind, *size)], prompts=[prompt])
    ids = inputs.pop("input_ids")
    pixels = inputs.pop("pixel_values")
    mask = inputs.pop("attention_mask")
    return ids, model.get_input_embeddings(ids, pixels, mask=mask, **inputs)


def _deepstack(features: Any, n: int) -> dict[str, Any]:
    """Qwen3-VL's deepstack inputs for the first `n` positions (all of the image is in them)."""
    if features.deepstack_visual_embeds is None:
        return {}
    return {
        "visual_pos_masks": features.visual_pos_masks[:, :n],
        "deepstack_visual_embeds": features.deepstack_visual_embeds,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_different_images_prefill_together_as_alone(family: str) -> None:
    """The engine's grouped prefill (engine/prefill.py `_whole_prompts`): rows right-padded to
    the longest, each its own image's embeddings (Qwen: its own 3-D positions, Qwen3-VL: its
    deepstack features in row order), mlx-lm batch caches prepared and finalized by
    `cache_kinds`; then one decode step together. Every row's logits are its logits alone."""
    from mlxgate.engine import cache_kinds

    lm = _language_model(family)
    rows = [_features(family, 0, "Hi"), _features(family, 1, "Describe the picture, please.")]
    lengths = [ids.shape[1] - 1 for ids, _ in rows]  # the last token is decoded
    width = max(lengths)
    alone = []
    for (ids, features), n in zip(rows, lengths, strict=True):
        cache = _mlx_lm_cache(_own_cache(family))
        extra = _deepstack(features, n)
        if features.position_ids is not None:
            extra["position_ids"] = features.position_ids[..., :n]
        lm(ids[:, :n], inputs_embeds=features.inputs_embeds[:, :n], cache=cache, **extra)
        alone.append(_decode(family, cache, ids[:, -1:], features.rope_deltas)[0])

    hidden = rows[0][1].inputs_embeds.shape[-1]
    dtype = rows[0][1].inputs_embeds.dtype
    tokens, embeds, positions, masks = [], [], [], []
    for (ids, features), n in zip(rows, lengths, strict=True):
        pad = width - n
        tokens.append(mx.pad(ids[:, :n], [(0, 0), (0, pad)]))
        embeds.append(
            mx.concatenate(
                [features.inputs_embeds[:, :n], mx.zeros((1, pad, hidden), dtype=dtype)], axis=1
            )
        )
        if features.position_ids is not None:
            own = features.position_ids[..., :n]
            after = own[..., -1:] + mx.arange(1, pad + 1)[None, None, :]
            positions.append(mx.concatenate([own, after], axis=-1))
        if features.visual_pos_masks is not None:
            masks.append(mx.pad(features.visual_pos_masks[:, :n], [(0, 0), (0, pad)]))
    extra = {}
    if positions:
        extra["position_ids"] = mx.concatenate(positions, axis=1)
    if rows[0][1].deepstack_visual_embeds is not None:
        extra["visual_pos_masks"] = mx.concatenate(masks)
        extra["deepstack_visual_embeds"] = [
            mx.concatenate(list(layer))
            for layer in zip(*(f.deepstack_visual_embeds for _, f in rows), strict=True)
        ]
    caches = []
    for layer in zip(*(_mlx_lm_cache(_own_cache(family)) for _ in rows), strict=True):
        cache = cache_kinds.merge(list(layer))
        cache.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
        caches.append(cache)
    lm(mx.concatenate(tokens), inputs_embeds=mx.concatenate(embeds), cache=caches, **extra)
    for cache in caches:
        cache.finalize()
    last = mx.concatenate([ids[:, -1:] for ids, _ in rows])
    deltas = None
    if rows[0][1].rope_deltas is not None:
        deltas = mx.concatenate([f.rope_deltas.reshape(1, 1) for _, f in rows])
    together = _decode(family, caches, last, deltas)
    for i, row in enumerate(alone):
        np.testing.assert_allclose(together[i], row, rtol=1e-5, atol=1e-5)
