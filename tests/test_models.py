"""The embedded GGUF model, loaded by mlx-lm once converted: tokenizer, weights, greedy decoding."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, cast

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


@pytest.mark.parametrize(("given", "read"), [(None, blas.THREAD_TIMEOUT), ("20", "20")])
def test_openblas_threads_spin_briefly_unless_told_otherwise(given: str | None, read: str) -> None:
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads: mlxgate's short spin, or the
    user's own value."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import os, mlxgate; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == read, done.stderr


def test_metadata(smollm: LoadedModel) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.context_length == 32768
    assert smollm.describe_context() == "32768 (YaRN x4 over 8192, its own rope within)"
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
        token = cast(int, mx.argmax(logits, axis=-1).item())  # an index
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

    from mlxgate.models.cpu import attention

    queries = mx.random.normal((rows, 9, n, 64), key=mx.random.key(1)) * 3
    keys = mx.random.normal((rows, 3, t, 64), key=mx.random.key(2))
    values = mx.random.normal((rows, 3, t, 64), key=mx.random.key(3))
    mask: Any = None if n == 1 else "causal"
    if padding is not None:
        mask = create_causal_mask(n, offset=t - n, left_padding=mx.array(padding))
    ours = attention.scaled_dot_product_attention(queries, keys, values, None, 0.125, mask)
    theirs = scaled_dot_product_attention(queries, keys, values, None, 0.125, mask)  # type: ignore[arg-type]
    # Query rows with no key to attend to (left padding only) are never used; compare the rest.
    used = np.ones((rows, 1, n), dtype=bool) if padding is None else np.asarray(mask).any(-1)
    used = np.broadcast_to(used, (rows, 9, n))
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)).max(axis=-1)
    assert diff[used].max() < 1e-5
    assert np.isfinite(np.asarray(ours)).all()


@pytest.mark.parametrize(("rows", "n", "t"), [(8, 1, 300), (1, 256, 1280), (2, 24, 60)])
def test_attention_with_latent_keys_equals_mlx(rows: int, n: int, t: int) -> None:
    """MLA (DeepSeek-V3, Kimi K2): one shared key/value head, values narrower than keys, and the
    rotary part of the scores passed as a per-head additive mask."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from mlxgate.models.cpu import attention

    queries = mx.random.normal((rows, 8, n, 48), key=mx.random.key(1))
    keys = mx.random.normal((rows, 1, t, 48), key=mx.random.key(2))
    values = keys[..., :32]
    position_scores = mx.random.normal((rows, 8, n, t), key=mx.random.key(4))
    ours = attention.scaled_dot_product_attention(queries, keys, values, None, 0.1, position_scores)
    theirs = scaled_dot_product_attention(queries, keys, values, None, 0.1, position_scores)
    assert ours.shape == theirs.shape == (rows, 8, n, 32)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5)


def test_swiglu_without_mlx_exp_equals_mlx() -> None:
    import mlx.core as mx
    from mlx_lm.models.activations import swiglu

    from mlxgate.models.cpu import fast_exp

    extremes = mx.array([-200.0, -80.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 80.0, 200.0])
    gate = mx.concatenate([mx.random.normal((64 * 1536,), key=mx.random.key(4)) * 6, extremes])
    x = mx.random.normal(gate.shape, key=mx.random.key(5))
    ours, theirs = np.asarray(fast_exp.swiglu(gate, x)), np.asarray(swiglu(gate, x))
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-30)


def tiny_llama(**overrides: Any) -> Any:
    """A random-weight mlx-lm llama, small enough to build per test."""
    from mlx_lm.models import llama

    args: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128,
    }
    return llama.Model(llama.ModelArgs(**{**args, **overrides}))


def test_kernels_go_to_one_instance_not_its_module_or_its_siblings() -> None:
    import mlx.core as mx
    from mlx_lm.models import activations, base, llama

    from mlxgate.models.cpu import attention, install_kernels, rebind

    ours, sibling = tiny_llama(), tiny_llama()
    sibling.update(ours.parameters())
    tokens = mx.array([list(range(64))])
    before = sibling(tokens)

    install_kernels(ours)
    assert attention.installed(ours)
    assert not attention.installed(sibling)
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert llama.swiglu is activations.swiglu
    assert type(sibling.model.layers[0].self_attn) is llama.Attention
    assert type(sibling.model.layers[0].mlp) is llama.MLP
    # Same weights, same answer, with and without the kernels (64 tokens: both kernels run).
    np.testing.assert_allclose(np.asarray(ours(tokens)), np.asarray(before), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(sibling(tokens)), np.asarray(before))

    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return base.scaled_dot_product_attention(*args, **kwargs)

    third = tiny_llama()
    rebind.install(
        third, "scaled_dot_product_attention", base.scaled_dot_product_attention, counted
    )
    mx.eval(third(tokens), sibling(tokens), ours(tokens))
    assert len(calls) == 4  # once per layer of `third`, never for the others


def test_prefill_fills_the_caches_as_mlx_lm_does_and_stops_between_layers() -> None:
    import mlx.core as mx

    from mlxgate.models.adapter import ModelAdapter

    # Sliding-window layers beside full ones: the mask is mlx-lm's business, not the adapter's.
    layer_types = ["sliding_attention", "full_attention"] * 2
    model, reference = (tiny_llama(layer_types=layer_types, sliding_window=8) for _ in range(2))
    reference.update(model.parameters())
    adapter = ModelAdapter(model)
    assert adapter.cancellable
    prompt = mx.array([[(7 * i) % 128 for i in range(20)]])

    caches, expected = model.make_cache(), reference.make_cache()
    for chunk in (prompt[:, :12], prompt[:, 12:]):
        assert adapter.prefill(chunk, caches, should_stop=lambda: False)
        reference.model(chunk, cache=expected)
    for ours, theirs in zip(caches, expected, strict=True):
        assert ours.offset == theirs.offset == 20
        for a, b in zip(ours.state, theirs.state, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)

    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return True

    caches = model.make_cache()
    assert not adapter.prefill(prompt, caches, should_stop=stop)
    assert asked == [1]
    assert [c.offset for c in caches] == [20, 0, 0, 0]
    # Outside a prefill with a stop check the layers are mlx-lm's as they were.
    np.testing.assert_array_equal(np.asarray(model(prompt)), np.asarray(reference(prompt)))


def test_greedy_decode_through_the_adapter_equals_mlx_lm(smollm: LoadedModel) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from mlxgate.models.adapter import ModelAdapter
    from mlxgate.models.cpu import attention

    tok = smollm.tokenizer
    prompt = tok.encode(tok.render([{"role": "user", "content": "Name three colors."}]))
    steps = 32
    # mlx-lm alone: a second instance over the same weights, without mlxgate's kernels.
    plain = llama.Model(smollm.model.args)
    served = dict(smollm.model.named_modules())  # quantized as the GGUF's blocks are served
    nn.quantize(
        plain,
        class_predicate=lambda path, _: (
            hasattr(served[path], "bits")
            and {"group_size": served[path].group_size, "bits": served[path].bits}
        ),
    )
    plain.update(smollm.model.parameters())
    assert not attention.installed(plain)
    expected = [int(token) for token, _ in generate_step(mx.array(prompt), plain, max_tokens=steps)]

    # Eight copies of the prompt: enough rows that both kernels run in decode steps too.
    adapter = ModelAdapter(smollm.model)
    assert adapter.banded_attention
    rows = 8
    caches = make_prompt_cache(smollm.model)
    assert adapter.prefill(mx.array([prompt[:-1]] * rows), caches, should_stop=lambda: False)
    inputs = mx.array([prompt[-1]] * rows)
    produced = []
    for _ in range(steps):
        inputs = mx.argmax(adapter.decode(inputs, caches), axis=-1)
        produced.append(np.asarray(inputs))
    tokens = np.stack(produced, axis=1)
    assert (tokens == np.array(expected)).all()
