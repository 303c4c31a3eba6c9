"""YaRN as its published definition computes it, held against the ropes mlxgate's models end up
with, measured from what each rope does to a probe (not read from mlxgate's code).

The reference below is written out from transformers' `_compute_yarn_parameters` and llama.cpp's
`ggml_rope_yarn_corr_dims` / `rope_yarn` (they agree): per rotated pair i of `dims`,
    own_i = base^(-2i/dims),  interpolated_i = own_i / factor,
    corr(r) = dims * ln(original / (2 pi r)) / (2 ln base),
    low = floor(corr(beta_fast)), high = ceil(corr(beta_slow)) (no rounding when truncate is
    false), clamped to [0, dims - 1],
    ramp_i = clip((i - low) / (high - low), 0, 1),
    inverse frequency_i = interpolated_i * ramp_i + own_i * (1 - ramp_i),
and both cos and sin (so queries and keys, and only their rotated dimensions) scaled by the
attention factor: `attention_factor` if given, else 0.1 ln(factor) + 1 (with `mscale` and
`mscale_all_dim`: the ratio of 0.1 m ln(factor) + 1 for the two).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from test_context import NATIVE, SCALED, model_dir

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate import models
from mlxgate.models import rope_switch


def reference(dims: int, base: float, scaling: dict[str, Any]) -> tuple[np.ndarray, float]:
    """(inverse frequency per rotated pair, attention factor)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def corr(rotations: float) -> float:
        return dims * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / max(high - low, 0.001), 0, 1)
    own = base ** (-np.arange(0, dims, 2) / dims)
    inverse = own / factor * ramp + own * (1 - ramp)

    def temperature(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0

    if "attention_factor" in scaling:
        attention = scaling["attention_factor"]
    else:
        attention = temperature(scaling.get("mscale", 1)) / temperature(
            scaling.get("mscale_all_dim", 0)
        )
    return inverse, attention


def measured(
    rope: Any, head_dim: int, dims: int, traditional: bool, inverse_guess: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `rope` does: per rotated pair, the angle per position and the scale, measured at a
    position where the angle is about 2 radians; and what it does to the unrotated dimensions."""
    import mlx.core as mx

    pairs = dims // 2
    angles, scales = np.zeros(pairs), np.zeros(pairs)
    for pair in range(pairs):
        first, second = (2 * pair, 2 * pair + 1) if traditional else (pair, pair + dims // 2)
        probe = np.zeros((1, 1, 1, head_dim), dtype=np.float32)
        probe[..., first] = 1.0
        position = max(1, round(2.0 / inverse_guess[pair]))
        out = np.array(rope(mx.array(probe), offset=position))[0, 0, 0]
        angles[pair] = math.atan2(out[second], out[first]) / position
        scales[pair] = math.hypot(out[first], out[second])
    rest = np.ones((1, 1, 1, head_dim), dtype=np.float32)
    untouched = np.array(rope(mx.array(rest), offset=7))[0, 0, 0, dims:]
    return angles, scales, untouched


def assert_reference(
    rope: Any, head_dim: int, dims: int, base: float, traditional: bool, scaling: dict[str, Any]
) -> None:
    inverse, attention = reference(dims, base, scaling)
    angles, scales, untouched = measured(rope, head_dim, dims, traditional, inverse)
    np.testing.assert_allclose(angles, inverse, rtol=2e-4)
    np.testing.assert_allclose(scales, attention, rtol=1e-5)
    np.testing.assert_array_equal(untouched, np.ones(head_dim - dims))


def yarn(factor: float, original: int = NATIVE, **keys: Any) -> dict[str, Any]:
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original, **keys}


@pytest.fixture(scope="module")
def embedded() -> models.LoadedModel:
    return models.load(None)


def test_the_embedded_model_scales_as_the_reference_and_keeps_its_own_rope(
    embedded: models.LoadedModel,
) -> None:
    """The GGUF's interleaved (traditional) layout, YaRN x4 over its 8,192 tokens."""
    rope = embedded.model.model.layers[0].self_attn.rope
    rows = rope_switch.rows_of(embedded.model)
    assert rows is not None
    own = 100000.0 ** (-np.arange(0, 64, 2) / 64)
    try:
        rows.scaled = True
        assert_reference(rope, 64, 64, 100000.0, True, yarn(4.0, 8192))
        rows.scaled = False
        angles, scales, _ = measured(rope, 64, 64, True, own)
        np.testing.assert_allclose(angles, own, rtol=2e-4)
        np.testing.assert_allclose(scales, 1.0, rtol=1e-6)
    finally:
        rows.scaled = True


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
@pytest.mark.parametrize("traditional", [False, True])
def test_served_past_the_native_context_scales_as_the_reference(
    tmp_path: Path, factor: float, traditional: bool
) -> None:
    directory = model_dir(tmp_path, "llama", rope_traditional=traditional)
    loaded = models.load(str(directory), context_length=int(factor * NATIVE))
    rope = loaded.model.model.layers[0].self_attn.rope
    head_dim = loaded.model.args.hidden_size // loaded.model.args.num_attention_heads
    base = loaded.model.args.rope_theta
    assert_reference(rope.scaled, head_dim, head_dim, base, traditional, yarn(factor))


def test_partial_rotary_dimensions_scale_as_the_reference(tmp_path: Path) -> None:
    """qwen3_next rotates a quarter of each head; the rest passes through unscaled."""
    directory = model_dir(tmp_path, "qwen3_next")
    loaded = models.load(str(directory), context_length=SCALED)
    args = loaded.model.args
    ropes = [m for m in loaded.model.modules() if isinstance(m, rope_switch.SwitchedRoPE)]
    assert ropes
    dims = int(args.head_dim * args.partial_rotary_factor)
    assert dims < args.head_dim
    assert_reference(ropes[0].scaled, args.head_dim, dims, args.rope_theta, False, yarn(4.0))


@pytest.mark.parametrize(
    "keys",
    [
        {"beta_fast": 16, "beta_slow": 2},
        {"mscale": 0.707, "mscale_all_dim": 0.707},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"attention_factor": 1.0},
        {"attention_factor": 1.25, "beta_fast": 24},
        {"truncate": False},
        {"truncate": False, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.1},
    ],
    ids=lambda keys: ",".join(keys),
)
def test_a_config_of_its_own_scales_as_the_reference(tmp_path: Path, keys: dict[str, Any]) -> None:
    """The keys a config.json's YaRN may carry (mlx-lm ignores attention_factor and truncate:
    mlxgate's models/yarn.py gives those ropes the reference values)."""
    scaling = yarn(4.0, **keys)
    directory = model_dir(tmp_path, "llama", rope_scaling=scaling)
    loaded = models.load(str(directory))
    assert loaded.context_length == SCALED
    args = loaded.model.args
    head_dim = args.hidden_size // args.num_attention_heads
    for layer in loaded.model.model.layers:
        assert_reference(layer.self_attn.rope, head_dim, head_dim, args.rope_theta, False, scaling)


@pytest.mark.parametrize("traditional", [False, True])
def test_linear_scaling_divides_every_frequency_and_leaves_the_magnitude(
    tmp_path: Path, traditional: bool
) -> None:
    """`--rope-scaling linear`: position interpolation, every pair's angle over the factor."""
    directory = model_dir(tmp_path, "llama", rope_traditional=traditional)
    loaded = models.load(str(directory), context_length=SCALED, rope_scaling="linear")
    rope = loaded.model.model.layers[0].self_attn.rope
    args = loaded.model.args
    head_dim = args.hidden_size // args.num_attention_heads
    own = args.rope_theta ** (-np.arange(0, head_dim, 2) / head_dim)
    angles, scales, _ = measured(rope.scaled, head_dim, head_dim, traditional, own / 4)
    np.testing.assert_allclose(angles, own / 4, rtol=2e-4)
    np.testing.assert_allclose(scales, 1.0, rtol=1e-6)
    angles, _, _ = measured(rope.native, head_dim, head_dim, traditional, own)
    np.testing.assert_allclose(angles, own, rtol=2e-4)


# llama.cpp's greedy answers on the same GGUF, recorded by benches/record_llama_greedy.py (the
# fixture names the commands). llama.cpp multiplies 4-bit weights by 8-bit activations where
# mlxgate uses float32: the two differ by that rounding, which flips a greedy choice now and then
# where two tokens nearly tie. So each answer is checked step by step, fed llama.cpp's tokens:
# llama.cpp's token must be mlxgate's best or within TIE_NATS of it. The wrong rope fails this
# (YaRN's answers against the native rope: 0.33-3.4 nats apart at worst, per prompt).
LLAMA_GREEDY = Path(__file__).resolve().parent / "fixtures" / "llama_cpp" / "greedy.json"
TIE_NATS = 0.35


def llama_prompts() -> list[dict[str, Any]]:
    import json

    prompts: list[dict[str, Any]] = json.loads(LLAMA_GREEDY.read_text())["prompts"]
    return prompts


def steps_apart(model: Any, prompt_ids: list[int], answer: list[int]) -> list[float]:
    """Per token of `answer`: how far below `model`'s best token it is (nats), fed the answer."""
    import mlx.core as mx

    logits = model(mx.array([prompt_ids + answer]))[0, len(prompt_ids) - 1 : -1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(answer)[:, None], axis=-1)[:, 0]
    return np.array(logprobs.max(axis=-1) - chosen).tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("rope", ["yarn", "native"])
def test_greedy_answers_follow_llama_cpp_on_the_same_gguf(
    embedded: models.LoadedModel, rope: str
) -> None:
    rows = rope_switch.rows_of(embedded.model)
    assert rows is not None
    try:
        rows.scaled = rope == "yarn"
        for item in llama_prompts():
            gaps = steps_apart(embedded.model, item["prompt_ids"], item[rope])
            assert 0 < len(gaps) <= 32
            assert max(gaps) < TIE_NATS, (item["question"], item[f"{rope}_text"], gaps)
            assert sum(gap > 0 for gap in gaps) <= 4, (item["question"], gaps)
    finally:
        rows.scaled = True


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from support.servers import start_server, stop_server

    running = start_server(tmp_path_factory.mktemp("default"))
    yield running
    stop_server(running)


def test_the_default_server_answers_short_prompts_as_the_model_itself(
    embedded: models.LoadedModel, default_server: Any
) -> None:
    """At the 32k default a short chat is served with the model's own rope: token for token the
    answers of the model at its own 8,192 tokens (here: its own rope, in process)."""
    import httpx
    import mlx.core as mx

    rows = rope_switch.rows_of(embedded.model)
    assert rows is not None
    tokenizer = embedded.tokenizer
    for item in llama_prompts()[:6]:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": item["question"]}],
            "max_tokens": 24,
            "temperature": 0,
        }
        reply = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert data["usage"]["prompt_tokens"] == len(item["prompt_ids"])
        own: list[int] = []
        try:
            rows.scaled = False
            for _ in range(24):
                logits = embedded.model(mx.array([item["prompt_ids"] + own]))[0, -1]
                token = cast(int, mx.argmax(logits).item())  # an index
                if token in tokenizer.eos_ids:
                    break
                own.append(token)
        finally:
            rows.scaled = True
        assert data["choices"][0]["message"]["content"] == tokenizer.decode(own), item["question"]
