"""mlx-vlm's own greedy generation on the tiny VLMs (support/tiny_vlms.py): offline, repeatable, and
the image is seen. The reference the served output will be held to (issue 36)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from support import tiny_vlms

FAMILIES = sorted(tiny_vlms.FAMILIES)
TOKENS = 8


def greedy(family: str, kind: int) -> tuple[list[int], Any]:
    """mlx-vlm's `stream_generate` at temperature 0 on one test image: the tokens and the first
    step's log-probabilities."""
    model, processor = tiny_vlms.load(family)
    prompt = tiny_vlms.PROMPTS[family].format(text="Describe the image.")
    results = list(
        tiny_vlms.stream_generate(
            model,
            processor,
            prompt,
            image=[tiny_vlms.image(kind)],
            max_tokens=TOKENS,
            temperature=0.0,
        )
    )
    first = tiny_vlms.logprobs(results[0])
    mx.eval(first)
    return [tiny_vlms.token(r) for r in results], np.array(first.astype(mx.float32))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_expands_the_image(family: str) -> None:
    """The processor turns one image into its placeholder tokens and pixel values, offline."""
    from mlx_vlm.utils import prepare_inputs

    _, processor = tiny_vlms.load(family)
    prompt = tiny_vlms.PROMPTS[family].format(text="Hi")
    inputs = prepare_inputs(processor, images=[tiny_vlms.image(0)], prompts=[prompt])
    ids = np.array(inputs["input_ids"]).ravel().tolist()
    image_id = tiny_vlms.image_token_id(family)
    assert ids.count(image_id) > 1
    assert inputs["pixel_values"] is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_deterministic(family: str) -> None:
    first, logits_a = greedy(family, 0)
    again, logits_b = greedy(family, 0)
    assert len(first) >= TOKENS
    assert first == again
    assert np.array_equal(logits_a, logits_b)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_image_changes_the_output(family: str) -> None:
    _, logits_a = greedy(family, 0)
    _, logits_b = greedy(family, 1)
    assert np.abs(logits_a - logits_b).max() > 1e-3
