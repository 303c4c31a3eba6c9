"""The embedded GGUF model: tokenizer rebuilt from metadata, weights loaded, greedy generation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate import blas
from mlxgate.models import LoadedModel, load


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load(None)


def test_openblas_is_in_use() -> None:
    assert blas.blas_in_use() == "OpenBLAS"


def test_metadata(smollm: LoadedModel) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.context_length == 8192
    assert smollm.tokenizer.vocab_size == 49152
    assert smollm.tokenizer.eos_ids == {2}  # <|im_end|>


def test_tokenizer_round_trips_and_knows_special_tokens(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    text = "Hello, wörld! 12345 😀 東京"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == 1
    assert tok.encode("123") == [tok.encode("1")[0], tok.encode("2")[0], tok.encode("3")[0]]


def test_chat_template_renders_chatml(smollm: LoadedModel) -> None:
    rendered = smollm.tokenizer.render([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_generation_is_sensible(smollm: LoadedModel) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tok = smollm.tokenizer
    prompt = tok.encode(tok.render([{"role": "user", "content": "What is the capital of France?"}]))
    cache = make_prompt_cache(smollm.model)
    logits = smollm.model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    out: list[int] = []
    for _ in range(24):
        token = int(mx.argmax(logits, axis=-1).item())
        if token in tok.eos_ids:
            break
        out.append(token)
        logits = smollm.model(mx.array([[token]]), cache=cache)[:, -1, :]
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize(
    ("rows", "n", "t", "padding"),
    [
        (1, 256, 1280, None),  # numpy: a prefill chunk deep into a prompt
        (4, 80, 120, [0, 7, 30, 55]),  # numpy: prompts prefilled together, left-padded
        (32, 1, 210, list(range(0, 160, 5))),  # MLX: a decode step of a left-padded batch
        (1, 1, 300, None),  # MLX: a decode step of one sequence (no mask)
        (1, 1, 100, None),  # MLX's own attention: too few scores to pay off
        (3, 24, 60, [0, 11, 40]),  # MLX: a small prefill, left-padded
        (1, 40, 90, None),  # MLX: a small causal chunk after a cached prefix
    ],
)
def test_attention_equals_mlx(rows: int, n: int, t: int, padding: list[int] | None) -> None:
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention

    from mlxgate.models import cpu_attention

    queries = mx.random.normal((rows, 9, n, 64), key=mx.random.key(1)) * 3
    keys = mx.random.normal((rows, 3, t, 64), key=mx.random.key(2))
    values = mx.random.normal((rows, 3, t, 64), key=mx.random.key(3))
    mask: Any = None if n == 1 else "causal"
    if padding is not None:
        mask = create_causal_mask(n, offset=t - n, left_padding=mx.array(padding))
    ours = cpu_attention.scaled_dot_product_attention(queries, keys, values, None, 0.125, mask)
    theirs = scaled_dot_product_attention(queries, keys, values, None, 0.125, mask)  # type: ignore[arg-type]
    # Query rows with no key to attend to (left padding only) are never used; compare the rest.
    used = np.ones((rows, 1, n), dtype=bool) if padding is None else np.asarray(mask).any(-1)
    used = np.broadcast_to(used, (rows, 9, n))
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)).max(axis=-1)
    assert diff[used].max() < 1e-5
    assert np.isfinite(np.asarray(ours)).all()


def test_swiglu_without_mlx_exp_equals_mlx() -> None:
    import mlx.core as mx
    from mlx_lm.models.activations import swiglu

    from mlxgate.models import fast_exp

    extremes = mx.array([-200.0, -80.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 80.0, 200.0])
    gate = mx.concatenate([mx.random.normal((64 * 1536,), key=mx.random.key(4)) * 6, extremes])
    x = mx.random.normal(gate.shape, key=mx.random.key(5))
    ours, theirs = np.asarray(fast_exp.swiglu(gate, x)), np.asarray(swiglu(gate, x))
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-30)
